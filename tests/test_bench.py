"""The benchmark framework: every benchmark's typed configuration and flags, the one table renderer,
and every stored results file printing again through its benchmark's report."""

from __future__ import annotations

import dataclasses
import importlib
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.__main__ import BENCHMARKS
from bench._framework import cell, env_name, parse_config, table


@pytest.mark.parametrize("name", BENCHMARKS)
def test_every_benchmark_has_a_typed_config_whose_defaults_are_its_flags_defaults(name, monkeypatch):
    module = importlib.import_module(f"bench.{name}")
    config_type = module.Config
    assert dataclasses.is_dataclass(config_type) and config_type.__dataclass_params__.frozen
    for field in dataclasses.fields(config_type):
        assert field.metadata.get("help"), f"{name}.{field.name} has no --help line"
        monkeypatch.delenv(env_name(name, field.name), raising=False)
    config, rest = parse_config(config_type, [], name)
    assert config == config_type() and rest == []


def test_flags_then_the_environment_then_the_defaults(monkeypatch):
    from bench.sweep import Config

    monkeypatch.setenv("ONNXPORT_BENCH_SWEEP_ROUNDS", "5")
    monkeypatch.setenv("ONNXPORT_BENCH_SWEEP_FAMILIES", "Bert,ViT")
    config, _ = parse_config(Config, ["--rounds", "3", "--text"], "sweep")
    assert config.rounds == 3 and config.families == ("Bert", "ViT") and config.text is True
    assert config.round_ms == 150.0  # neither given: the default
    assert "GPT2" in config.chosen() and config.chosen()[:2] == ("Bert", "ViT")
    config, _ = parse_config(Config, ["--no-text"], "sweep")
    assert config.rounds == 5 and config.text is False


@pytest.mark.parametrize(("argv", "said"), [
    (["--families", "Nope"], "unknown families Nope"),        # the benchmark's own check
    (["--rounds", "many"], "--rounds takes int values"),      # the type
    (["--rounds", "0"], "--rounds must be at least 1"),
    (["--bogus"], "unrecognized arguments: --bogus"),
    (["--optimum", "optimum-cli"], "--optimum is for --front-door"),
    (["--front-door", "--families", "GPT2"], "GPT2 are decoders"),
])
def test_a_bad_flag_exits_2_naming_it(argv, said, capsys):
    from bench.sweep import Config

    with pytest.raises(SystemExit) as stopped:
        parse_config(Config, argv, "sweep")
    assert stopped.value.code == 2 and said in capsys.readouterr().err


def test_choices_are_checked_item_by_item(capsys):
    from bench.seq2seq import Config

    assert parse_config(Config, ["--models", "whisper"], "seq2seq")[0].models == ("whisper",)
    with pytest.raises(SystemExit):
        parse_config(Config, ["--models", "t5,bart"], "seq2seq")
    assert "bart is not one of t5, whisper" in capsys.readouterr().err


def test_the_table_renderer_lines_columns_up_and_refuses_a_ragged_row():
    text = table(["model", "ms"], [["BERT", cell(1.234, ".2f")], ["ResNet-50", cell(None, ".2f")]],
                 title="Latency", notes=["one note"])
    lines = text.splitlines()
    assert lines[0] == "Latency" and lines[-1] == "one note"
    rows = [line for line in lines if line.startswith("|")]
    assert rows[0] == "| model     | ms   |" and rows[2] == "| BERT      | 1.23 |" and rows[3] == "| ResNet-50 | -    |"
    assert len({len(r) for r in rows}) == 1  # every line as wide: the columns line up
    assert cell("failed", ".2f") == "failed" and cell(3, "") == "3"
    with pytest.raises(ValueError, match="2 cells for 3 columns"):
        table(["a", "b", "c"], [["1", "2"]])


def _stored() -> list[tuple[str, str, dict]]:
    """(file, benchmark, figures) for every benchmark's figures in bench/results."""
    found = []
    for path in sorted((ROOT / "bench" / "results").glob("*.json")):
        results = json.loads(path.read_text())
        found += [(path.name, name, results[name]) for name in BENCHMARKS if name in results]
    return found


@pytest.mark.parametrize(("file", "name", "figures"), _stored(), ids=lambda v: v if isinstance(v, str) else "")
def test_every_stored_results_file_prints_again_through_its_report(file, name, figures):
    text = importlib.import_module(f"bench.{name}").report(figures)
    header = next(line for line in text.splitlines() if line.startswith("| "))
    rule = text.splitlines()[text.splitlines().index(header) + 1]
    assert set(rule) <= {"|", "-"} and rule.count("|") == header.count("|")


def test_the_runner_refuses_a_flag_no_chosen_benchmark_takes_before_anything_runs():
    def bench(*argv: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "bench", *argv], capture_output=True, text=True, cwd=ROOT,
                              timeout=300, check=False)

    wrong = bench("float_export", "--rounds", "2")
    assert wrong.returncode == 2 and "--rounds: no chosen benchmark (float_export) takes this flag" in wrong.stderr
    bad = bench("sweep", "--families", "Nope")
    assert bad.returncode == 2 and "unknown families Nope" in bad.stderr and "CPU:" not in bad.stdout
    helped = bench("float_export", "qdq_export", "--help")
    assert helped.returncode == 0 and "python -m bench float_export" in helped.stdout and "--repeat" in helped.stdout
    assert "python -m bench qdq_export" in helped.stdout
    stored = max((ROOT / "bench" / "results").glob("*-seq2seq.json"))
    again = bench("--tables", str(stored))
    assert again.returncode == 0 and "| model" in again.stdout and "Encoder-decoder generation" in again.stdout


def test_the_sweep_compares_files_round_by_round_and_calls_a_family_below_only_beyond_its_own_spread():
    from bench.sweep import SAME, _pairwise, dynamic_report

    # the machine drifts by 2x across rounds; ORT's file is 5 % faster in every round
    drift = [1.0, 2.0, 1.0, 2.0, 1.5]
    ms = lambda factor: {1: [d * factor for d in drift]}
    rounds = {"fp32": ms(2.0), "ours": ms(1.0), "ours_dynamic": ms(1.0), SAME: ms(1.01),
              "ort_static": ms(1.1), "ort_dynamic": ms(0.95), "ort_dynamic_rr": ms(1.2)}
    speedup = {"fp32": 1.0, "ours": 2.0, "ours_dynamic": 2.0, SAME: 1.98, "ort_static": 1.82, "ort_dynamic": 2.1,
               "ort_dynamic_rr": 1.67}
    pairs = _pairwise(rounds, speedup)
    assert pairs["ours_dynamic_vs_ort_dynamic"] == pytest.approx(0.95)  # against the faster ORT file
    assert pairs["ours_vs_ort_static"] == pytest.approx(1.1)
    assert pairs["ours_dynamic_vs_itself"] == pytest.approx(1.01)

    def row(itself: float) -> dict:
        return {"speedup": speedup, "pairwise": {**pairs, "ours_dynamic_vs_itself": itself},
                "ours_dynamic": {"cosine": 1.0, "rounding_floor": [1.0], "within_floor": True},
                "dynamic_ops": {"ours_only": {}, "ort_only": {"DequantizeLinear": 1}}}

    below = lambda text: text.splitlines()[-1]
    assert below(dynamic_report({"Bert": row(1.01)})).endswith(": Bert")  # 5 % below, the file moves 1 %
    assert below(dynamic_report({"Bert": row(0.94)})).endswith(": none")  # the file moved as far from itself
    assert "— / DequantizeLinear 1" in dynamic_report({"Bert": row(1.0)})
