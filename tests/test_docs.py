"""Results and the docs that cite them: every file under benchmarks/results/ is cited by the
README, a doc, benchmarks/README.md, jax_sdpa/tuning.py or a tuning table in cuda/, and every
results path those cite exists.

A file is cited by its path under results/ (`h200/peers_all.json`, with or without the
`benchmarks/results/` prefix), or by its bare name in a text that names its device folder
(`results/h200`): tables list bare names below the folder they come from."""

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
# a results path in a citing text: benchmarks/results/<...> or results/<...>, a file or a folder
_CITED_PATH = re.compile(r"(?<![\w.-])(?:benchmarks/)?results/((?:[\w.+-]+/)*[\w.+-]*)")


def _citing_texts():
    paths = [ROOT / "README.md", ROOT / "benchmarks" / "README.md",
             ROOT / "jax_sdpa" / "tuning.py"]
    paths += sorted((ROOT / "docs").glob("*.md")) + sorted((ROOT / "cuda").rglob("*.h"))
    return {p.relative_to(ROOT).as_posix(): p.read_text() for p in paths if p.exists()}


def _results_files():
    return sorted(p.relative_to(RESULTS).as_posix() for p in RESULTS.rglob("*") if p.is_file())


def _cited(rel, texts):
    device, name = rel.split("/", 1)[0], rel.rsplit("/", 1)[-1]
    bare = re.compile(rf"(?<![\w/.+-]){re.escape(name)}(?![\w.+-])")
    for text in texts.values():
        if f"results/{rel}" in text or f"`{rel}`" in text:
            return True
        if f"results/{device}" in text and bare.search(text):
            return True
    return False


def test_every_result_is_cited():
    texts = _citing_texts()
    uncited = [rel for rel in _results_files() if not _cited(rel, texts)]
    assert not uncited, f"results cited by no doc (cite them or delete them): {uncited}"


def test_every_cited_result_exists():
    missing = []
    for source, text in _citing_texts().items():
        for m in _CITED_PATH.finditer(text):
            rel = m.group(1).rstrip(".")
            if rel and not (RESULTS / rel).exists():
                missing.append(f"{source}: results/{rel}")
    assert not missing, f"cited results that don't exist: {sorted(set(missing))}"


def test_the_checks_see_the_results():
    files = _results_files()
    assert any(f.startswith("h200/") for f in files) and any(f.startswith("cpu_2core/")
                                                           for f in files)
    texts = {"a.md": "`benchmarks/results/h200/x.json`, plot `x.png`; results/h200/y/"}
    assert _cited("h200/x.png", texts) and not _cited("cpu_2core/x.png", texts)
    assert not _cited("h200/peers.png", {"b.md": "results/h200/a.json, results/cpu/peers.png"})
