"""The onnxport command through real processes and real files."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest

ROOT = Path(__file__).resolve().parents[1]


def onnxport(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "onnxport", *args], capture_output=True, text=True, cwd=cwd, timeout=600,
                          check=False)


@pytest.mark.parametrize("command", ["demo", "export", "qdq", "encodings", "stats", "verify", "debug", "bench"])
def test_every_command_has_help(command):
    result = onnxport(command, "--help")
    assert result.returncode == 0 and "usage: onnxport" in result.stdout


def test_verbose_logs_each_export_step_and_the_file_proofs(tmp_path):
    out = tmp_path / "tiny.onnx"
    quiet = onnxport("export", "tests.cli_models:tiny", "--input-shape", "2,3,8,8", "-o", str(out))
    loud = onnxport("-v", "export", "tests.cli_models:tiny", "--input-shape", "2,3,8,8", "-o", str(out))
    assert quiet.returncode == loud.returncode == 0, loud.stderr
    assert "onnxport: step 'lower to opset 17': changed the graph; proof: identical outputs" in loud.stderr
    assert "onnxport: proving the file: onnx.checker (full), opset 17" in loud.stderr
    assert "proven and in place" in loud.stderr
    assert "onnxport: step" not in quiet.stderr


def test_verify_judges_by_the_float_floor_unless_a_tolerance_is_given(tmp_path):
    out = tmp_path / "tanh.onnx"  # tiny_mlp's weights, its GELUs as the tanh form: another function
    assert onnxport("export", "tests.cli_models:tiny_mlp_tanh_gelu", "--input-shape", "2,16", "-o", str(out)).returncode == 0
    right = onnxport("verify", "tests.cli_models:tiny_mlp_tanh_gelu", str(out), "--input-shape", "32,16")
    assert right.returncode == 0 and "float64 run as the reference" in right.stdout, right.stderr
    wrong = onnxport("verify", "tests.cli_models:tiny_mlp", str(out), "--input-shape", "32,16")
    assert wrong.returncode == 1 and "within its own float floor" in wrong.stderr, wrong.stdout
    loose = onnxport("verify", "tests.cli_models:tiny_mlp", str(out), "--input-shape", "32,16", "--atol", "1e-2")
    assert loose.returncode == 0 and "atol 0.01" in loose.stdout, loose.stdout


def test_export_verify_and_static_int8_with_random_calibration(tmp_path):
    out = tmp_path / "tiny.onnx"
    result = onnxport("export", "tests.cli_models:tiny", "--input-shape", "2,3,8,8", "-o", str(out))
    assert result.returncode == 0, result.stderr
    onnx.checker.check_model(str(out))
    result = onnxport("verify", "tests.cli_models:tiny", str(out), "--input-shape", "5,3,8,8")
    assert result.returncode == 0 and "yes" in result.stdout
    q = tmp_path / "tiny_s8.onnx"
    result = onnxport("export", "tests.cli_models:tiny", "--input-shape", "2,3,8,8", "-o", str(q), "--quantize", "static",
                      "--calibration", "random")
    assert result.returncode == 0, result.stderr
    assert "RANDOM CALIBRATION" in result.stderr
    assert any(n.op_type == "QuantizeLinear" for n in onnx.load(str(q)).graph.node)


def test_qdq_from_npz_then_stats_json_then_encodings_round_trip(tmp_path):
    calib = tmp_path / "calib.npz"
    np.savez(calib, np.random.default_rng(0).standard_normal((16, 3, 8, 8)).astype(np.float32))
    out = tmp_path / "tiny_qdq.onnx"
    result = onnxport("qdq", "tests.cli_models:tiny", "--input-shape", "2,3,8,8", "-o", str(out), "--calibration", str(calib),
                      "--target", "onnxruntime")
    assert result.returncode == 0, result.stderr
    result = onnxport("stats", str(out), "--json")
    report = json.loads(result.stdout)
    # the conv's and the classifier's weights, and their int32 biases
    assert result.returncode == 0 and report["stats"]["n_per_channel"] == 4 and report["extra"]["ort_int8"]["Conv"]["int8"] == 1
    # encodings: write them from the file, strip it to float, convert back
    from onnxport import onnx_qdq_to_encodings, strip_qdq

    model = onnx.load(str(out))
    (tmp_path / "tiny.encodings").write_text(json.dumps(onnx_qdq_to_encodings(model)))
    onnx.save(strip_qdq(model), str(tmp_path / "float.onnx"))
    back = tmp_path / "back.onnx"
    result = onnxport("encodings", str(tmp_path / "float.onnx"), str(tmp_path / "tiny.encodings"), "-o", str(back),
                      "--force-activation-as", "none", "--prequantize-constants")
    assert result.returncode == 0, result.stderr
    # the int32 biases travel through the encodings (as 32-bit parameter encodings) and back
    assert json.loads(onnxport("stats", str(back), "--json", "--no-ort").stdout)["stats"]["n_per_channel"] == 4


def test_qdq_weight_only_int4_from_token_ids(tmp_path):
    out = tmp_path / "lm_int4.onnx"
    result = onnxport("qdq", "tests.cli_models:tiny_lm", "--input-shape", "2,8", "--token-ids", "64", "-o", str(out),
                      "--weight-only", "int4", "--group-size", "16", "--quantize-embeddings", "--asymmetric")
    assert result.returncode == 0, result.stderr
    stats = json.loads(onnxport("stats", str(out), "--json").stdout)
    assert stats["opset"] == 21 and stats["stats"]["n_int4"] == 4 and stats["stats"]["n_blocked"] == 4
    assert stats["extra"]["ort_matmul_nbits"] == 3


@pytest.mark.parametrize(
    "args, message",
    [
        (["qdq", "tests.cli_models:tiny_lm", "--input-shape", "1,8", "--token-ids", "64", "-o", "x.onnx",
          "--weight-only", "int4", "--group-size", "24"], "group_size=24 does not divide"),
        (["qdq", "tests.cli_models:tiny_lm", "--input-shape", "1,8", "--token-ids", "64", "-o", "x.onnx",
          "--weight-only", "int4", "--group-size", "16", "--opset", "18"], "opset_version=21"),
        (["export", "tests.cli_models:tiny", "-o", "x.onnx"], "--input-shape"),
        (["export", "tests.cli_models", "--input-shape", "1,3,8,8", "-o", "x.onnx"], "package.module:callable"),
        (["export", "tests.cli_models:not_a_model", "--input-shape", "1,3,8,8", "-o", "x.onnx"], "not a torch.nn.Module"),
        (["export", "tests.cli_models:failing_factory", "--input-shape", "1,3,8,8", "-o", "x.onnx"],
         "calling 'failing_factory()' raised FileNotFoundError: weights.pt not found"),
        (["export", "tests.cli_models:tiny", "--input-shape", "1,a", "-o", "x.onnx"], "is not a shape"),
        (["qdq", "tests.cli_models:tiny", "--input-shape", "2,3,8,8", "-o", "x.onnx"], "--calibration"),
        (["stats", "missing.onnx"], "does not exist"),
    ],
)
def test_bad_usage_exits_2_and_writes_nothing(tmp_path, args, message, capsys):
    # through main() in this process (the other tests here start the real entry point): a process
    # each would spend its seconds importing torch before the one-line refusal
    from onnxport.cli import main

    try:
        code = main([a if a != "x.onnx" else str(tmp_path / "x.onnx") for a in args])
    except SystemExit as usage:  # argparse's own usage errors
        code = usage.code
    err = capsys.readouterr().err
    assert code == 2 and message in err, err
    assert "Traceback" not in err and list(tmp_path.iterdir()) == []


def test_refusal_exits_1_without_traceback_and_leaves_no_file(tmp_path):
    out = tmp_path / "trt.onnx"
    result = onnxport("qdq", "tests.cli_models:tiny", "--input-shape", "2,3,8,8", "-o", str(out), "--calibration", "random",
                      "--target", "tensorrt", "--activation-dtype", "uint8")
    assert result.returncode == 1 and "refused" in result.stderr and "breaks target 'tensorrt'" in result.stderr
    assert "Traceback" not in result.stderr and list(tmp_path.iterdir()) == []
    debug = onnxport("--debug", "qdq", "tests.cli_models:tiny", "--input-shape", "2,3,8,8", "-o", str(out), "--calibration",
                     "random", "--target", "tensorrt", "--activation-dtype", "uint8")
    assert "Traceback" in debug.stderr


@pytest.mark.slow
def test_demo_quick_writes_every_section(tmp_path):
    result = onnxport("demo", "--quick", "--no-progress", "--out", str(tmp_path / "demo"))
    assert result.returncode == 0, result.stderr
    report = json.loads((tmp_path / "demo" / "report.json").read_text())
    assert set(report) >= {"training", "files", "pt2e", "encodings_round_trip", "seconds"}
    assert set(report["files"]) == {"fp32", "ort_dynamic_int8", "ort_static_int8", "qdq_int8", "qdq_uint8", "qdq_opset17",
                                    "qdq_onnxruntime", "qdq_from_encodings"}
    assert report["files"]["fp32"]["verified"] and report["encodings_round_trip"]["byte_identical"]
    assert report["files"]["qdq_int8"]["verify_qdq"] >= 0.99 and report["files"]["qdq_opset17"]["opset"] == 17
    assert report["training"]["test_accuracy"] > 0.6
    assert "AIMET encodings round trip" in result.stdout


def test_export_from_a_saved_torch_export_program(tmp_path):
    import torch

    from tests.cli_models import tiny

    program = torch.export.export(tiny(), (torch.randn(2, 3, 8, 8),))
    torch.export.save(program, str(tmp_path / "tiny.pt2"))
    out = tmp_path / "from_pt2.onnx"
    result = onnxport("export", str(tmp_path / "tiny.pt2"), "--input-shape", "2,3,8,8", "-o", str(out), "--static-batch")
    assert result.returncode == 0, result.stderr
    onnx.checker.check_model(str(out))


def _bad_files(folder):
    """Every kind of broken ONNX input a user hands the CLI."""
    good = folder / "good.onnx"
    model = onnx.helper.make_model(onnx.helper.make_graph(
        [onnx.helper.make_node("Relu", ["x"], ["y"])], "g",
        [onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [1, 4])],
        [onnx.helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [1, 4])]))
    onnx.save(model, str(good))
    (folder / "corrupt.onnx").write_bytes(b"\x07this is not protobuf")
    (folder / "empty.onnx").write_bytes(b"")
    (folder / "truncated.onnx").write_bytes(good.read_bytes()[:20])
    (folder / "folder.onnx").mkdir()
    (folder / "notes.onnx").write_text("hello: this is a text file\n")
    return {"corrupt": "not a readable ONNX model", "empty": "is empty", "truncated": "not a readable ONNX model",
            "folder": "is a directory", "missing": "does not exist", "notes": "ONNX"}


@pytest.mark.parametrize("command", ["stats", "encodings"])
def test_every_broken_input_file_is_a_named_usage_error_without_traceback(tmp_path, command, capsys):
    from onnxport.cli import main

    expected = _bad_files(tmp_path)
    encodings = tmp_path / "e.encodings"
    encodings.write_text('{"version": "2.0.0", "encodings": []}')
    for kind, message in expected.items():
        path = str(tmp_path / f"{kind}.onnx")
        args = ["stats", path] if command == "stats" else ["encodings", path, str(encodings), "-o", str(tmp_path / "out.onnx")]
        if kind == "corrupt":  # one through the real entry point, a process of its own
            result = onnxport(*args)
            code, err = result.returncode, result.stderr
        else:  # the rest through the same main() in this process (each process start imports torch)
            code, err = main(args), capsys.readouterr().err
        assert code == 2, (kind, err)
        assert "Traceback" not in err and message in err and path in err, (kind, err)
    assert not (tmp_path / "out.onnx").exists()


def test_the_file_only_commands_never_import_torch(tmp_path):
    """stats and encodings read and write ONNX files only: importing torch would cost each run
    seconds before its first line of output."""
    _bad_files(tmp_path)
    encodings = tmp_path / "e.encodings"
    encodings.write_text('{"version": "2.0.0", "encodings": []}')
    good, out = tmp_path / "good.onnx", tmp_path / "out.onnx"
    script = (f"import sys; from onnxport.cli import main; "
              f"codes = [main(['stats', {str(good)!r}]), main(['encodings', {str(good)!r}, {str(encodings)!r}, '-o', {str(out)!r}])]; "
              f"print(codes, 'torch' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=ROOT, timeout=300, check=False)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == "[0, 0] False" and out.is_file()


def test_debug_and_verify_name_a_broken_file_too(tmp_path):
    _bad_files(tmp_path)
    for args in (["debug", "unused.pt2", str(tmp_path / "truncated.onnx"), "--input-shape", "1,4", "--optimized"],
                 ["verify", "tests.cli_models:tiny", str(tmp_path / "empty.onnx"), "--input-shape", "1,3,8,8"]):
        result = onnxport(*args)
        assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
        assert "truncated.onnx" in result.stderr or "empty.onnx" in result.stderr


@pytest.mark.slow
def test_broken_model_and_calibration_files_are_named_usage_errors(tmp_path):
    """The MODEL (.pt2) and --calibration inputs get the same contract as the ONNX files."""
    (tmp_path / "empty.pt2").write_bytes(b"")
    (tmp_path / "corrupt.pt2").write_bytes(b"PK\x03\x04 not a zip archive")
    (tmp_path / "folder.pt2").mkdir()
    (tmp_path / "bad.npy").write_bytes(b"\x93NUMPY garbage")
    (tmp_path / "bad.npz").write_bytes(b"not a zip")
    cases = {
        "empty.pt2": "is empty", "corrupt.pt2": "could not be loaded as a torch.export program",
        "folder.pt2": "is a directory", "missing.pt2": "does not exist",
    }
    out = tmp_path / "x.onnx"
    for name, message in cases.items():
        path = str(tmp_path / name)
        result = onnxport("export", path, "--input-shape", "1,3,8,8", "-o", str(out))
        assert result.returncode == 2 and message in result.stderr and path in result.stderr, (name, result.stderr)
        assert "Traceback" not in result.stderr
    for name in ("bad.npy", "bad.npz", "missing.npz"):
        path = str(tmp_path / name)
        result = onnxport("qdq", "tests.cli_models:tiny", "--input-shape", "2,3,8,8", "-o", str(out), "--calibration", path)
        assert result.returncode == 2 and path in result.stderr and "Traceback" not in result.stderr, (name, result.stderr)
    assert not out.exists()


def test_exit_codes_have_one_meaning_each_and_help_lists_them():
    from onnxport.cli import EXIT_CODES, exit_code
    from onnxport.errors import DependencyError, ExportRefusedError, InvalidArgumentError, WriteError

    assert sorted(EXIT_CODES) == [0, 1, 2, 3, 4, 5, 130]
    assert [exit_code(e) for e in (InvalidArgumentError("x"), ExportRefusedError("x"), WriteError("x"),
                                   DependencyError("x"), KeyboardInterrupt(), ZeroDivisionError("x"))] == [2, 1, 4, 5, 130, 3]
    result = onnxport("--help")
    assert result.returncode == 0 and all(meaning[:30] in " ".join(result.stdout.split()) for meaning in EXIT_CODES.values())


def test_a_write_failure_exits_4_not_as_a_refusal(tmp_path):
    """A full disk (here a file-size limit) is not onnxport refusing the model."""
    import resource

    def small_files() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (2000, 2000))

    out = tmp_path / "m.onnx"
    result = subprocess.run([sys.executable, "-m", "onnxport", "export", "tests.cli_models:tiny", "--input-shape", "1,3,8,8",
                             "-o", str(out)], capture_output=True, text=True, cwd=ROOT, timeout=600, preexec_fn=small_files,
                            check=False)
    assert result.returncode == 4, result.stderr
    assert "could not write" in result.stderr and "refused" not in result.stderr and "Traceback" not in result.stderr
    assert list(tmp_path.iterdir()) == []


def test_an_unexpected_error_exits_3_with_a_report_request(monkeypatch, capsys, tmp_path):
    import onnxport
    from onnxport import cli

    path = tmp_path / "m.onnx"
    onnx.save(onnx.helper.make_model(onnx.helper.make_graph(
        [onnx.helper.make_node("Relu", ["x"], ["y"])], "g", [onnx.helper.make_tensor_value_info("x", 1, [1])],
        [onnx.helper.make_tensor_value_info("y", 1, [1])])), str(path))

    def broken(*args, **kwargs):
        raise ZeroDivisionError("a bug")

    monkeypatch.setattr(onnxport, "qdq_report", broken)
    assert cli.main(["stats", str(path)]) == 3
    err = capsys.readouterr().err
    assert "did not expect: ZeroDivisionError: a bug" in err and "--debug" in err and "Traceback" not in err


def test_an_interrupt_exits_130_and_keeps_no_output(tmp_path):
    """Ctrl-C in the middle of the work (the demo's training loop, seen on its progress bar)."""
    import signal
    import threading
    import time

    out = tmp_path / "demo"
    # a test worker (pytest-xdist) ignores SIGINT, and a child inherits that: Python then installs no
    # KeyboardInterrupt handler, so the child gets the default disposition back, as a shell gives it
    process = subprocess.Popen([sys.executable, "-m", "onnxport", "demo", "--quick", "--out", str(out)],
                               cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                               preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))  # noqa: PLW1509
    chunks: list[bytes] = []
    # drained all along: a full pipe would block the demo's progress bar, not the demo's work
    reader = threading.Thread(target=lambda: chunks.extend(iter(lambda: process.stderr.read1(4096), b"")), daemon=True)
    reader.start()
    deadline = time.monotonic() + 300
    while b"training" not in b"".join(chunks) and time.monotonic() < deadline and process.poll() is None:
        time.sleep(0.05)
    assert b"training" in b"".join(chunks), b"".join(chunks)[-500:]
    process.send_signal(signal.SIGINT)
    process.wait(timeout=300)
    reader.join(timeout=60)
    err = b"".join(chunks).decode(errors="replace")
    assert process.returncode == 130 and "interrupted" in err and "Traceback" not in err, err[-800:]
    assert not out.exists() or not any(out.iterdir())
