"""`save_pretrained` of every family is crash-safe: a save that fails or is killed (SIGKILL) at any file operation
leaves a folder that the Auto classes load as the old model or as the new one, exactly, never a mix; files beside the
model are kept; leftovers are cleaned by the next save; nothing is written outside the target folder.

The old model (hidden size 32, one weights file) is overwritten by a differently shaped new one (hidden size 48,
sharded with an index), so a mix of the two would not load or would load wrong weights."""

import builtins
import errno
import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch
import transformers.modeling_utils
from conftest import WHERE, tiny_config
from remote_code import run_without_dat_hf
from test_seq2seq import seq2seq_config
from test_vision import vision_config
from transformers import AutoModelForCausalLM, AutoModelForImageClassification, AutoModelForSeq2SeqLM

from dat_hf import DATForCausalLM, DATForImageClassification, DATForSeq2SeqLM
from dat_hf.atomic_save import BACKUP_PREFIX, JOURNAL, STAGING_PREFIX, finish_interrupted_save

FAMILIES = {
    "causal-lm": (DATForCausalLM, tiny_config, AutoModelForCausalLM),
    "vision": (DATForImageClassification, vision_config, AutoModelForImageClassification),
    "seq2seq": (DATForSeq2SeqLM, seq2seq_config, AutoModelForSeq2SeqLM),
}
SHARD = "100KB"  # the new model is written in several shards
USER_FILES = {"tokenizer.json": '{"user": "tokenizer"}', "README.md": "model card"}
MUTATING_OS_FUNCTIONS = ("replace", "rename", "link", "unlink", "remove", "rmdir", "mkdir", "fsync")  # + open, rmtree


class FileOps:
    """Wraps every file operation a save makes (the mutating `os` functions, `open` for writing and the safetensors
    writer), logs it and calls `before(index, name, args)` ahead of it (indices from 1). A context manager."""

    def __init__(self, before=None):
        self.before, self.log, self._originals = before, [], []

    def __enter__(self):
        for name in MUTATING_OS_FUNCTIONS:
            self._wrap(os, name)
        self._wrap(builtins, "open", writes_only=True)
        self._wrap(transformers.modeling_utils, "safe_save_file")
        self._wrap(shutil, "rmtree")
        return self

    def __exit__(self, *exc):
        for module, name, original in reversed(self._originals):
            setattr(module, name, original)

    def _wrap(self, module, name, writes_only=False):
        original = getattr(module, name)

        def wrapper(*args, **kwargs):
            mode = args[1] if len(args) > 1 else kwargs.get("mode", "r")
            if not writes_only or any(c in str(mode) for c in "wax+"):
                relative = "dir_fd" in kwargs  # (rmtree's inner calls: names relative to a folder it opened)
                paths = [os.fspath(a) for a in args[:1 if writes_only else 2]
                         if isinstance(a, (str, os.PathLike)) and not relative]
                self.log.append((name, paths))
                if self.before is not None:
                    self.before(len(self.log), name, args)
            return original(*args, **kwargs)

        setattr(module, name, wrapper)
        self._originals.append((module, name, original))


def injection_points(log, every_op: bool) -> list[int]:
    """Every operation of the save (`every_op`, the slow run), or a sample: every 8th, each kind's first, and the
    steps around the journal's rename, the switch and the commit point."""
    if every_op:
        return list(range(1, len(log) + 1))
    journal = next(i for i, (name, paths) in enumerate(log, 1)
                   if name == "replace" and os.path.basename(paths[1]) == JOURNAL)
    commit = commit_index(log)
    first_of_kind = {name: i for i, (name, _) in reversed(list(enumerate(log, 1)))}
    steps = {journal - 1, journal, journal + 1, (journal + commit) // 2, commit - 1, commit, commit + 1, commit + 2}
    return sorted({*range(1, len(log) + 1, 8), *first_of_kind.values(), *steps})


EVERY_OP = pytest.mark.parametrize("every_op", [False, pytest.param(True, marks=pytest.mark.slow)],
                                   ids=["sampled-ops", "every-op"])


def commit_index(log) -> int:
    """The index of the commit point in a save's log: the new config.json renamed into the folder."""
    return next(i for i, (name, paths) in enumerate(log, 1)
                if name == "replace" and STAGING_PREFIX in paths[0] and os.path.basename(paths[1]) == "config.json"
                and STAGING_PREFIX not in paths[1])


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, tmp_path_factory):
    """(name, old model, new model, a folder holding the old model and user files, the log of a clean new save)."""
    cls, make_config, _ = FAMILIES[request.param]
    torch.manual_seed(0)
    old = cls(make_config(hidden_size=32)).eval()
    torch.manual_seed(1)
    new = cls(make_config(hidden_size=48)).eval()
    template = tmp_path_factory.mktemp(request.param) / "model"
    old.save_pretrained(template)
    for name, text in USER_FILES.items():
        (template / name).write_text(text)
    dry_run = template.parent / "dry-run"
    shutil.copytree(template, dry_run)
    with FileOps() as ops:
        new.save_pretrained(dry_run, max_shard_size=SHARD)
    assert len(list(dry_run.glob("model-*-of-*.safetensors"))) >= 2 and not (dry_run / "model.safetensors").exists()
    return request.param, old, new, template, ops.log


def loaded_as(family, folder) -> str:
    """Load the folder with the family's Auto class; 'old' or 'new' if every tensor equals that model's exactly."""
    name, old, new, _, _ = family
    loaded = FAMILIES[name][2].from_pretrained(folder)
    state = loaded.state_dict()
    for label, model in (("old", old), ("new", new)):
        expected = model.state_dict()
        if state.keys() == expected.keys() and all(
                state[k].shape == expected[k].shape and torch.equal(state[k], expected[k]) for k in expected):
            return label
    raise AssertionError(f"{folder} loads as neither the old nor the new model")


def assert_user_files_kept(folder):
    for name, text in USER_FILES.items():
        assert (folder / name).read_text() == text


def assert_next_save_is_clean(family, folder):
    """The next save removes every leftover and the folder then loads as the new model."""
    _, _, new, _, _ = family
    new.save_pretrained(folder, max_shard_size=SHARD)
    assert not [n for n in os.listdir(folder) if n.startswith((STAGING_PREFIX, BACKUP_PREFIX, JOURNAL))]
    assert loaded_as(family, folder) == "new"
    assert_user_files_kept(folder)


def fresh_copy(family, tmp_path, k):
    folder = tmp_path / f"op-{k}"
    shutil.copytree(family[3], folder)
    return folder


@EVERY_OP
def test_failure_at_every_file_operation(family, tmp_path, every_op):
    """The k-th file operation of the save raises OSError (disk full, I/O error), for every k: the save raises or
    works around it, and the folder loads as the old model (failure up to the commit point) or the new one."""
    _, _, new, _, log = family
    commit = commit_index(log)
    for k in injection_points(log, every_op):
        folder = fresh_copy(family, tmp_path, k)

        def fail(index, name, args, k=k):
            if index == k:
                raise OSError(errno.EIO, f"injected failure of {name}")

        try:
            with FileOps(fail):
                new.save_pretrained(folder, max_shard_size=SHARD)
            failed = False
        except OSError:
            failed = True
        expected = "old" if failed and k <= commit else "new"
        assert loaded_as(family, folder) == expected, (k, log[k - 1])
        assert_user_files_kept(folder)
        if k % 10 == 0 or k in (commit - 1, commit, commit + 1):
            assert_next_save_is_clean(family, folder)


def kill_during_save(new, folder, k) -> int:
    """Save in a forked child that stops at its k-th file operation; the parent kills it with SIGKILL there.
    Returns the child's wait status."""
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # child: never returns into pytest
        try:
            os.close(read_end)

            def stop(index, name, args):
                if index == k:
                    os.write(write_end, b"k")
                    time.sleep(60)

            with FileOps(stop):
                new.save_pretrained(folder, max_shard_size=SHARD)
        finally:
            os._exit(0)
    os.close(write_end)
    reached = os.read(read_end, 1)
    os.close(read_end)
    assert reached == b"k", f"the save ended before its operation {k}"
    os.kill(pid, signal.SIGKILL)
    return os.waitpid(pid, 0)[1]


@EVERY_OP
def test_kill_9_at_every_file_operation(family, tmp_path, every_op):
    """A process saving the new model is killed with SIGKILL before its k-th file operation, for every k: the folder
    loads as the old model (killed up to the commit point) or the new one, and the next save cleans up."""
    _, _, new, _, log = family
    commit = commit_index(log)
    for k in injection_points(log, every_op):
        folder = fresh_copy(family, tmp_path, k)
        status = kill_during_save(new, folder, k)
        assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL
        assert loaded_as(family, folder) == ("old" if k <= commit else "new"), (k, log[k - 1])
        assert_user_files_kept(folder)
        if k % 10 == 0 or k in (commit - 1, commit, commit + 1):
            assert_next_save_is_clean(family, folder)


def test_save_writes_nothing_outside_the_target(family, tmp_path):
    """Staging, backup and journal live inside the target: every file operation of an overwrite is inside it, and
    the parent's listing is unchanged (so a writable target in a read-only parent is enough)."""
    _, _, new, template, _ = family
    folder = fresh_copy(family, tmp_path, "outside")
    before = sorted(os.listdir(tmp_path))
    with FileOps() as ops:
        new.save_pretrained(folder, max_shard_size=SHARD)
    for name, paths in ops.log:
        for path in paths:
            assert os.path.commonpath([os.path.abspath(path), folder]) == str(folder), (name, path)
    assert sorted(os.listdir(tmp_path)) == before
    assert loaded_as(family, folder) == "new"


@pytest.fixture
def read_only_parent(tmp_path):
    """A folder in which creating files fails, even as root: `chattr +i` (the immutable attribute binds root too);
    without root, a plain chmod."""
    parent = tmp_path / "parent"
    parent.mkdir()
    (parent / "model").mkdir()
    if os.geteuid() == 0:
        if shutil.which("chattr") is None or subprocess.run(["chattr", "+i", str(parent)]).returncode != 0:
            pytest.skip("as root, a read-only folder needs `chattr +i`, which this file system refuses")
        undo = ["chattr", "-i", str(parent)]
    else:
        parent.chmod(0o555)
        undo = ["chmod", "755", str(parent)]
    try:
        with pytest.raises(OSError):
            (parent / "probe").write_text("x")
        yield parent
    finally:
        subprocess.run(undo, check=True)


def test_save_into_a_folder_whose_parent_is_read_only(read_only_parent):
    """Save, overwrite with a differently shaped model, load: only the target folder is written."""
    folder = read_only_parent / "model"
    torch.manual_seed(0)
    old = DATForCausalLM(tiny_config(hidden_size=32))
    old.save_pretrained(folder)
    torch.manual_seed(1)
    new = DATForCausalLM(tiny_config(hidden_size=48))
    new.save_pretrained(folder, max_shard_size=SHARD)
    loaded = AutoModelForCausalLM.from_pretrained(folder)
    assert all(torch.equal(v, new.state_dict()[k]) for k, v in loaded.state_dict().items())
    assert os.listdir(read_only_parent) == ["model"]


def test_leftovers_without_journal_are_ignored_then_removed(tmp_path):
    """Staging / backup folders and a half-written journal of a save killed before its journal was in place do not
    change what loads, and the next save deletes them."""
    torch.manual_seed(0)
    model = DATForCausalLM(tiny_config())
    model.save_pretrained(tmp_path)
    for name in (STAGING_PREFIX + "x", BACKUP_PREFIX + "x"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "model.safetensors").write_bytes(b"garbage")
    (tmp_path / f"{JOURNAL}.tmp-x").write_text("{")
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in loaded.state_dict().items())
    model.save_pretrained(tmp_path)
    assert not [n for n in os.listdir(tmp_path) if n.startswith(".")]


def test_journal_naming_paths_outside_the_folder_is_refused(tmp_path):
    """A journal is only trusted with plain file names: one that reaches outside the folder is an error, and
    nothing is touched."""
    outside = tmp_path / "outside.txt"
    outside.write_text("keep")
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / JOURNAL).write_text(json.dumps({
        "staging": STAGING_PREFIX + "a", "backup": BACKUP_PREFIX + "a", "old": ["../outside.txt"], "new": [],
        "config_sha256": "0"}))
    with pytest.raises(ValueError, match="is not a dat_hf save journal"):
        finish_interrupted_save(folder)
    assert outside.read_text() == "keep"


REMOTE_CHILD = r'''
import hashlib, json, sys
sys.modules["dat_hf"] = None  # `import dat_hf` fails: the classes come from the folders' own code
from transformers import AutoModelForCausalLM

report = {}
for folder in sys.argv[1:]:
    try:
        model = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True)
    except OSError as error:
        report[folder] = {"refused": str(error)}
    else:
        report[folder] = {"module": type(model).__module__, "weights": {
            k: hashlib.sha256(v.contiguous().numpy().tobytes()).hexdigest() for k, v in model.state_dict().items()}}
print(json.dumps(report))
'''


def weight_digests(model) -> dict:
    import hashlib

    return {k: hashlib.sha256(v.contiguous().numpy().tobytes()).hexdigest() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("where", WHERE)
def test_remote_code_refuses_an_interrupted_save(tmp_path, where):
    """In a process without dat_hf, `from_pretrained(..., trust_remote_code=True)` runs the folder's own modeling
    code, which holds no repair (`atomic_save.py` is not copied): it refuses a folder with an interrupted save, naming
    the journal, and touches nothing; dat_hf then completes or undoes the save: killed before the commit point -> old
    model, after -> new model; the remote code loads the repaired folder."""
    torch.manual_seed(0)
    old = DATForCausalLM(tiny_config(hidden_size=32))
    torch.manual_seed(1)
    new = DATForCausalLM(tiny_config(hidden_size=48))
    template = tmp_path / "template"
    old.save_pretrained(template)
    shutil.copytree(template, tmp_path / "dry-run")
    with FileOps() as ops:
        new.save_pretrained(tmp_path / "dry-run", max_shard_size=SHARD)
    commit = commit_index(ops.log)
    folders = {}
    for label, k in (("old", commit), ("new", commit + 1)):
        folders[label] = tmp_path / label
        shutil.copytree(template, folders[label])
        kill_during_save(new, folders[label], k)
        assert (folders[label] / JOURNAL).exists()  # an interrupted save, left for the loader to repair
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONSTARTUP", "PYTHONHOME")}
    env.update(HF_MODULES_CACHE=str(tmp_path / "modules"), HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")

    def run_child():
        stdout = run_without_dat_hf(where, REMOTE_CHILD, folders.values(), cwd=tmp_path, env=env)
        return json.loads(stdout.strip().splitlines()[-1])

    report = run_child()
    for folder in folders.values():
        assert str(folder / JOURNAL) in report[str(folder)]["refused"]
        assert "interrupted save" in report[str(folder)]["refused"]
        assert (folder / JOURNAL).exists()  # untouched
    for label, model in (("old", old), ("new", new)):
        assert weight_digests(DATForCausalLM.from_pretrained(folders[label])) == weight_digests(model)
        assert not (folders[label] / JOURNAL).exists()
    report = run_child()
    for label, model in (("old", old), ("new", new)):
        loaded = report[str(folders[label])]
        assert loaded["module"].startswith("transformers_modules.")
        assert loaded["weights"] == weight_digests(model)


# ---- planted links, damaged journals --------------------------------------------------------------------------------
def interrupted_save(tmp_path):
    """A folder whose save (old model: seed 0, hidden 32, one file; new: seed 1, hidden 48, sharded) stopped right
    after its journal was in place, before the commit point, as a kill there: (folder, old model, journal)."""
    import dat_hf.atomic_save as atomic_save

    torch.manual_seed(0)
    old = DATForCausalLM(tiny_config(hidden_size=32))
    old.save_pretrained(tmp_path)
    torch.manual_seed(1)
    new = DATForCausalLM(tiny_config(hidden_size=48))

    def killed(directory, journal):
        raise KeyboardInterrupt

    saved = atomic_save._roll_forward, atomic_save.repair
    atomic_save._roll_forward, atomic_save.repair = killed, lambda directory: None  # (a kill runs no clean-up)
    try:
        with pytest.raises(KeyboardInterrupt):
            atomic_save.save_atomically(tmp_path, lambda staging: transformers.PreTrainedModel.save_pretrained(
                new, staging, max_shard_size=SHARD))
    finally:
        atomic_save._roll_forward, atomic_save.repair = saved
    journal = json.loads((tmp_path / JOURNAL).read_text())
    assert (tmp_path / journal["backup"] / JOURNAL).is_file()  # the copy a damaged journal is repaired from
    return tmp_path, old, journal


def same_weights(a, b):
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_damaged_journal_is_repaired_from_the_backup_copy(tmp_path, caplog):
    for damage in ("{", "{}", '{"staging": ".dat_hf_staging-x"}'):
        folder = tmp_path / f"case{len(damage)}"
        folder, old, journal = interrupted_save(folder)
        (folder / JOURNAL).write_text(damage)
        with caplog.at_level("WARNING", logger="dat_hf.atomic_save"):
            loaded = AutoModelForCausalLM.from_pretrained(folder)
        assert same_weights(loaded.state_dict(), old.state_dict()), damage  # rolled back: the old model
        assert any("was damaged" in r.getMessage() and str(folder / JOURNAL) in r.getMessage() for r in caplog.records)
        assert not [n for n in os.listdir(folder) if n.startswith(".")]


def test_damaged_journal_without_an_intact_copy_names_the_file_and_what_to_do(tmp_path):
    folder, old, journal = interrupted_save(tmp_path)
    (folder / JOURNAL).write_text("{")
    (folder / journal["backup"] / JOURNAL).write_text("{}")
    with pytest.raises(ValueError) as error:
        AutoModelForCausalLM.from_pretrained(folder)
    message = str(error.value)
    assert str(folder / JOURNAL) in message and "not JSON" in message
    assert str(folder / journal["backup"]) in message and "move them into" in message


def test_planted_links_are_never_followed(tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "keep.txt").write_text("keep")
    folder = tmp_path / "model"
    torch.manual_seed(0)
    model = DATForCausalLM(tiny_config())
    model.save_pretrained(folder)
    for name in (STAGING_PREFIX + "planted", BACKUP_PREFIX + "planted"):  # leftovers that are links: removed
        os.symlink(outside, folder / name)
    model.save_pretrained(folder)  # used to fail: "Cannot call rmtree on a symbolic link"
    assert (outside / "keep.txt").read_text() == "keep"
    assert not [n for n in os.listdir(folder) if n.startswith(".")]

    folder2, old, journal = interrupted_save(tmp_path / "interrupted")
    backup = folder2 / journal["backup"]
    shutil.rmtree(backup)
    os.symlink(outside, backup)  # the journal's backup replaced by a link out of the folder
    with pytest.raises(ValueError, match=rf"{backup} is a symbolic link where the interrupted save .* does not follow"):
        AutoModelForCausalLM.from_pretrained(folder2)
    assert sorted(os.listdir(outside)) == ["keep.txt"]
    os.symlink(outside / "keep.txt", folder / JOURNAL)
    with pytest.raises(ValueError, match=rf"{folder / JOURNAL} is a symbolic link, not a dat_hf save journal"):
        AutoModelForCausalLM.from_pretrained(folder)
    assert (outside / "keep.txt").read_text() == "keep"


# ---- readers racing a writer ----------------------------------------------------------------------------------------
RACE_WRITER = r'''
import sys, torch
from conftest import tiny_config
from remote_code import run_without_dat_hf
from dat_hf import DATForCausalLM
folder, saves = sys.argv[1], int(sys.argv[2])
model = DATForCausalLM(tiny_config(vocab_size=200, intermediate_size=96))
for k in range(1, saves + 1):
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(float(k))
    model.config.pad_token_id = k
    model.save_pretrained(folder, max_shard_size="20KB")  # 5-6 shards
    print(k, flush=True)
'''


def race(tmp_path, saves, capsys=None):
    """A writer process saves `saves` sharded models (every weight = k, `pad_token_id` = k in save k) into one
    folder while this process loads it in a loop through the model class and the Auto class. Returns (loads, mixes,
    reloads announced)."""
    import logging

    folder = tmp_path / "raced"
    torch.manual_seed(0)
    model = DATForCausalLM(tiny_config(vocab_size=200, intermediate_size=96))
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(0.0)
    model.config.pad_token_id = 0
    model.save_pretrained(folder, max_shard_size="20KB")
    writer = subprocess.Popen([sys.executable, "-c", RACE_WRITER, str(folder), str(saves)],
                              cwd=os.path.dirname(__file__), stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                              env={**os.environ, "PYTHONPATH": os.pathsep.join(  # (this checkout's dat_hf)
                                  [os.path.dirname(__file__), os.path.dirname(os.path.dirname(__file__))])})
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logging.getLogger("dat_hf.atomic_save").addHandler(handler)
    loads, mixes = 0, []
    try:
        while writer.poll() is None:
            for loader in (DATForCausalLM, AutoModelForCausalLM):
                loaded = loader.from_pretrained(folder)
                values = {float(v) for p in loaded.state_dict().values() for v in p.unique()}
                loads += 1
                if len(values) != 1:
                    mixes.append(("weights", sorted(values)))
                elif loaded.config.pad_token_id != int(values.pop()):
                    mixes.append(("config", loaded.config.pad_token_id))
    finally:
        logging.getLogger("dat_hf.atomic_save").removeHandler(handler)
        writer.kill()
    assert writer.wait() == 0 and writer.stdout.read().split()[-1] == str(saves).encode()
    reloads = [r.getMessage() for r in records if "again" in r.getMessage() or "waited" in r.getMessage()]
    return loads, mixes, reloads


@pytest.mark.integration
def test_readers_racing_a_writer_never_load_a_mix(tmp_path):
    loads, mixes, reloads = race(tmp_path, saves=25)
    print(f"race: {loads} loads during 25 sharded saves, {len(mixes)} mixes, {len(reloads)} reloads/waits announced")
    assert loads >= 10
    assert mixes == []


@pytest.mark.slow
def test_readers_racing_a_writer_never_load_a_mix_long(tmp_path):
    loads, mixes, reloads = race(tmp_path, saves=400)
    print(f"race: {loads} loads during 400 sharded saves, {len(mixes)} mixes, {len(reloads)} reloads/waits announced")
    assert loads >= 100 and mixes == []


def test_a_config_read_before_a_save_commits_is_read_again(tmp_path):
    """`import dat_hf` has DAT configs remember what `from_dict` read (`safe_folders.config_source`): a config read
    (as AutoConfig does) before another save commits is read again, so the new weights never get the old config."""
    import logging

    from transformers import AutoConfig

    from dat_hf.safe_folders import config_source

    folder = tmp_path / "model"
    DATForCausalLM(tiny_config(vocab_size=200, pad_token_id=1)).save_pretrained(folder)
    config = AutoConfig.from_pretrained(folder)
    assert config_source(config)[0]["pad_token_id"] == 1
    DATForCausalLM(tiny_config(vocab_size=200, pad_token_id=2)).save_pretrained(folder)
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logging.getLogger("dat_hf.safe_folders").addHandler(handler)
    try:
        loaded = DATForCausalLM.from_pretrained(folder, config=config)
    finally:
        logging.getLogger("dat_hf.safe_folders").removeHandler(handler)
    assert loaded.config.pad_token_id == 2
    assert any("changed after it was read" in r.getMessage() for r in records)
