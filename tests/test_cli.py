"""The `jax-sdpa` command line, run through `main([...])`."""

import json

import pytest

from jax_sdpa import _ext, bench, cli


def test_info(capsys):
    assert cli.main(["info"]) == 0
    out = capsys.readouterr().out
    assert "jax_sdpa" in out and "jaxlib" in out
    for module in _ext.status():
        assert module in out
    assert "implementation=None ->" in out
    for name in ("cudnn", "cuda", "metal", "cpu", "xla", "xla_chunked"):
        assert name in out


def test_check_quick(capsys):
    impls = ["xla_chunked"] + [n for n in ("cpu",) if _ext.has_backend(n)]
    code = cli.main(["check", "--quick"] + [a for n in impls for a in ("-i", n)])
    out = capsys.readouterr().out
    assert code == 0, out
    lines = [ln for ln in out.splitlines() if ln.startswith(("ok", "FAIL", "SKIP"))]
    assert len(lines) == len(impls) * 3 * 2  # implementations x cases x directions
    assert all(ln.startswith("ok") for ln in lines), out
    assert "all passed" in out


def test_check_reports_failure(monkeypatch, capsys):
    # a broken implementation must give a FAIL line and a non-zero exit
    monkeypatch.setattr(cli, "_tolerance", lambda impl, dtype, xla_err: -1.0)
    one_case = cli._check_cases(quick=True)[:1]
    monkeypatch.setattr(cli, "_check_cases", lambda quick: one_case)
    assert cli.main(["check", "--quick", "-i", "xla_chunked"]) == 1
    assert "FAIL" in capsys.readouterr().out


def test_bench_tiny_json_and_plot(tmp_path, capsys):
    path = tmp_path / "bench.json"
    impls = ["xla_chunked", "jax.nn:xla"] + [n for n in ("cpu",) if _ext.has_backend(n)]
    argv = ["bench", "--suite", "tiny", "--json", str(path), "--min-time", "0.01",
            "--no-progress"] + [a for n in impls for a in ("-i", n)]
    try:
        import matplotlib  # noqa: F401
        plot = tmp_path / "bench.png"
        argv += ["--plot", str(plot)]
    except ImportError:
        plot = None
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    assert "jax.nn:xla" in out and "xla_chunked" in out
    report = json.loads(path.read_text())
    assert {"date", "device", "versions", "results", "suite"} <= set(report)
    assert report["suite"] == "tiny"
    cases, dirs = bench.SUITES["tiny"]
    assert len(report["results"]) == len(cases) * len(dirs) * len(impls)
    for r in report["results"]:
        assert r["error"] is None or r["error"].startswith("refused"), r
        if r["error"] is None:
            assert r["time_s"] > 0 and r["tflops"] > 0
    if plot is not None:
        assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bench_list(capsys):
    assert cli.main(["bench", "--list"]) == 0
    out = capsys.readouterr().out
    for suite in ("tiny", "cpu-small", "prefill", "decode", "sd3"):
        assert suite in out


def test_demo_fast(capsys):
    pytest.importorskip("flax")
    assert cli.main(["demo", "--small", "--steps", "2"]) == 0
    out = capsys.readouterr().out
    for phase in ("prefill", "decode", "train"):
        assert phase in out
    assert "flax default" in out and "(reference)" in out
    # every jax_sdpa row agrees with Flax's default attention
    import re
    deltas = [float(x) for x in re.findall(r"(\d\.\d\de[-+]\d\d)", out)]
    assert deltas and max(deltas) < 1e-3, out
