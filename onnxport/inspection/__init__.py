"""Reading Q/DQ files: the Q/DQ view of a graph, its statistics and report, the target rules, and the
checks that a file's pairs are its model's."""
