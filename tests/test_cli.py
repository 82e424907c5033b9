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
    # two jax_sdpa rows a phase, each with its difference from Flax (none raised)
    assert len(deltas) >= 6, out


def test_demo_counts_refusals_apart_from_failures():
    # an explicit implementation's NotImplementedError, and a cuDNN graph our handler
    # refused when it was built (a runtime error with our message), are refusals
    refused = [NotImplementedError("jax_sdpa: implementation='cuda' can't serve this call: "
                                   "no kernel"),
               RuntimeError("UNIMPLEMENTED: jax_sdpa: cuDNN 91900 can't serve this attention "
                            "call (backward B=1 ...): graph validation: D > 256")]
    for e in refused:
        assert cli._demo_error(e).startswith("refused: "), e
    assert cli._demo_error(TypeError("missing 1 required positional argument")) == (
        "TypeError: missing 1 required positional argument")


def test_demo_fails_when_a_phase_raises(monkeypatch, capsys):
    pytest.importorskip("flax")
    from jax_sdpa.examples import gpt

    def broken(*args):
        raise TypeError("no train step here")

    broken.lower = broken
    monkeypatch.setattr(gpt, "_loss_and_grads", broken)
    assert cli.main(["demo", "--small", "--steps", "2"]) == 1
    err = capsys.readouterr().err
    assert "train with" in err and "TypeError: no train step here" in err, err


def test_check_unknown_implementation_lists_the_names(capsys):
    assert cli.main(["check", "-i", "flash"]) == 2
    err = capsys.readouterr().err
    assert "'flash'" in err
    for name in ("cudnn", "cuda", "metal", "cpu", "xla", "xla_chunked"):
        assert name in err
    with pytest.raises(ValueError, match="unknown implementation 'flash'.*xla_chunked"):
        cli.run_checks(["flash"])


def test_check_of_an_implementation_that_cannot_run_here_fails(capsys):
    # on a CPU machine cudnn (and cuda) can't run; on a GPU machine cpu and metal can't
    platform = bench.default_platform()
    here = bench.available_implementations(platform, include_emulator=True)
    absent = [n for n in ("cudnn", "cuda", "metal", "cpu") if n not in here]
    assert absent
    for name in absent:
        assert cli.main(["check", "--quick", "-i", name]) == 2
        captured = capsys.readouterr()
        assert "all passed" not in captured.out and "SKIP" not in captured.out
        assert f"{name} can't run here: " in captured.err
    if not _ext.has_backend("metal"):  # the build's own reason and fix
        from jax_sdpa import build_info
        cli.main(["check", "-i", "metal"])
        assert build_info.backend("metal")["reason"] in capsys.readouterr().err


def test_check_where_every_case_is_skipped_is_a_failure(monkeypatch, capsys):
    from jax_sdpa import dispatch
    real = dispatch.supports
    monkeypatch.setattr(dispatch, "supports", lambda name, *a: (False, "refused for the test")
                        if name == "xla_chunked" else real(name, *a))
    assert cli.main(["check", "--quick", "-i", "xla_chunked"]) == 1
    out = capsys.readouterr().out
    assert "all passed" not in out and "no check ran" in out


def test_bench_plot_needs_matplotlib_before_timing(monkeypatch, capsys):
    monkeypatch.setitem(__import__("sys").modules, "matplotlib", None)  # import fails

    def no_timing(*a, **k):
        raise AssertionError("the suite ran before --plot's requirement was checked")

    monkeypatch.setattr(bench, "run_suite", no_timing)
    assert cli.main(["bench", "--suite", "tiny", "--plot", "x.png"]) == 2
    assert "jax_sdpa[bench]" in capsys.readouterr().err


@pytest.mark.parametrize("steps", ["0", "-3"])
def test_demo_steps_must_be_positive(steps, capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["demo", "--steps", steps])
    assert e.value.code == 2
    assert "must be at least 1" in capsys.readouterr().err


def test_help_texts(capsys):
    with pytest.raises(SystemExit):
        cli.main(["bench", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert f"default {bench.DEFAULT_SUITE}" in out
    assert "which cases to time" in out and "forward + backward" in out
    with pytest.raises(SystemExit):
        cli.main(["check", "--help"])
    assert "seed of the random inputs" in " ".join(capsys.readouterr().out.split())


def test_info_and_explain_say_what_the_marks_mean(capsys):
    assert cli.main(["info"]) == 0
    out = capsys.readouterr().out
    legend = "(* what implementation=None runs, + can serve this call too, - can't)"
    assert out.count(legend) == len(cli._sample_explains())
    import jax
    import jax_sdpa
    s = jax.ShapeDtypeStruct((1, 2, 8, 16), "float32")
    assert str(jax_sdpa.explain(s, s, s)).endswith(legend)


def test_info_shows_why_a_backend_is_missing_and_the_fix(capsys):
    from jax_sdpa import build_info
    assert cli.main(["info"]) == 0
    out = capsys.readouterr().out
    for backend, module in build_info.MODULES.items():
        record = build_info.backend(backend)
        if module in _ext.status() and not _ext.status()[module].startswith("loaded"):
            line = next(ln for ln in out.splitlines() if ln.strip().startswith(module))
            if not record["built"]:
                assert record["reason"] in line, line
                if record.get("fix"):
                    assert f"to build it: {record['fix']}" in line, line
