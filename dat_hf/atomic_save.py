# Copyright 2026 The dat_hf Authors. All rights reserved.
#
# Licensed under the MIT License (the "License"); you may not use this file except in compliance with the
# License. See the LICENSE file at the root of the dat_hf repository.
"""Crash-safe saving of a model folder: after a save that fails or is killed at any point, the folder loads as the
previous model or as the new one, never as a mix of both.

Everything happens inside the target folder (only the target needs to be writable):

1. stage:   the new model is written into `.dat_hf_staging-<id>/` inside the target;
2. backup:  the current model files (`config.json`, `generation_config.json`, weights in any layout, and every file
            the new save overwrites) are hard-linked (or copied) into `.dat_hf_backup-<id>/`;
3. journal: `.dat_hf_commit.json` lists the staging and backup folders, the old and new files and the SHA-256 of the
            new `config.json`; it is written beside and renamed into place (atomic);
4. switch:  every new file but `config.json` is renamed into the target; old model files that the new save lacks
            (e.g. the shards of a differently sharded model) are removed;
5. commit:  the new `config.json` is renamed over the old one: this one atomic rename is the commit point;
6. clean:   the journal, then the backup and staging folders are removed.

A folder with a journal is repaired before it is read, by the next save and by `from_pretrained` of every DAT class
(installed by `import dat_hf` through `safe_folders.py`; a folder's remote code, without dat_hf, saves and loads as
Transformers does): if `config.json` is the new one (its hash is in the journal) the save is rolled
forward (new files moved in, old-only files removed), else rolled back (old files restored from the backup, new-only
files removed). Either way the weights agree with the `config.json` that the Auto classes read before the model
class runs. Staging or backup folders without a journal are leftovers of a save stopped before step 3: deleted.

A copy of the journal is kept in the backup folder: a damaged journal (not JSON, fields missing) is repaired from it;
without an intact copy the error names the journal and says what to do. A symbolic link where a staging or backup
folder is expected is never followed: a leftover link is removed (not its target), a link named by a journal stops
the repair with an error naming it.

Readers: `from_pretrained` of every DAT class waits (briefly) while a journal says a switch is in progress, notes the
model files' identities (inode, size, time) before loading and after, and loads again when they changed during the
load (a save committed meanwhile), logging which model it returned; see `load_consistently`.

Files other than the model's (tokenizer, processor, model card, metrics) are never moved or deleted. A directory swap
(`renameat2(RENAME_EXCHANGE)`) would also be atomic for readers that do not repair, but it needs a writable parent,
is Linux-only and would swap those other files away; the journal works the same everywhere. Saves into one folder
are serialized by an advisory lock on the folder (POSIX).
"""

import contextlib
import hashlib
import json
import logging
import os
import re
import shutil
import tempfile
import time

logger = logging.getLogger(__name__)

STAGING_PREFIX = ".dat_hf_staging-"
BACKUP_PREFIX = ".dat_hf_backup-"
JOURNAL = ".dat_hf_commit.json"  # (a folder's remote code, without dat_hf, refuses a folder holding one)
CONFIG = "config.json"
# Transformers' files of one model: configs and weights in any layout (single file, shards, index, variants, .bin)
READ_WAIT_SECONDS = 10.0  # how long a reader waits for a save's switch to commit
READ_ATTEMPTS = 5  # loads a reader tries while saves keep changing the folder under it
MODEL_FILE = re.compile(r"(config\.json|generation_config\.json|"
                        r"(pytorch_)?model([.-][^/\\]*)?\.(safetensors|bin)(\.index(\.[^./\\]+)?\.json)?)")


def save_atomically(directory, write):
    """Save a model into `directory` with `write(staging_dir)` (e.g. `PreTrainedModel.save_pretrained`), then switch
    the folder from the old model to the new one as described in the module docstring."""
    directory = os.path.abspath(os.fspath(directory))
    if os.path.isfile(directory):
        raise ValueError(f"`save_directory` ({directory}) must be a folder, not a file.")
    os.makedirs(directory, exist_ok=True)
    with _locked(directory):
        repair(directory)
        staging = tempfile.mkdtemp(prefix=STAGING_PREFIX, dir=directory)
        try:
            write(staging)
            _commit(directory, staging)
        except BaseException:
            with contextlib.suppress(Exception):
                repair(directory)  # undo (or complete, after the commit point) now; else the next save or load does
            raise
        repair(directory)


def finish_interrupted_save(directory):
    """Repair a local folder left by an interrupted save (no-op without a journal, e.g. for a Hub repo id)."""
    if directory is None or not os.path.isfile(os.path.join(os.fspath(directory), JOURNAL)):
        return
    directory = os.path.abspath(os.fspath(directory))
    try:
        with _locked(directory, timeout=READ_WAIT_SECONDS):
            repair(directory)
    except OSError as error:
        raise OSError(f"{directory} holds an interrupted save ({JOURNAL}) that could not be completed or undone: "
                      f"{error}. Make the folder writable and load it again.") from error


def repair(directory):
    """Roll an interrupted save forward or back (after its journal) and delete leftovers of earlier saves."""
    journal = _read_journal(directory)
    if journal is not None:
        committed = _sha256(os.path.join(directory, CONFIG)) == journal["config_sha256"]
        (_roll_forward if committed else _roll_back)(directory, journal)
        os.unlink(os.path.join(directory, JOURNAL))
        fsync_dir(directory)
    for name in os.listdir(directory):
        path = os.path.join(directory, name)
        if name.startswith((STAGING_PREFIX, BACKUP_PREFIX)):
            if os.path.islink(path) or not os.path.isdir(path):  # not made by a save: removed, never followed
                logger.warning("dat_hf: removed %s, a %s where dat_hf keeps a save's temporary folder (its target, "
                               "if any, is untouched).", path, "symbolic link" if os.path.islink(path) else "file")
                os.unlink(path)
            else:
                shutil.rmtree(path)
        elif name.startswith(JOURNAL + ".tmp"):
            os.unlink(path)


def _files_state(directory):
    """The identity (name, inode, size, modification time) of the folder's model files and whether a journal is
    there: any switch of a save changes it (new files are renamed in, so they are new inodes)."""
    state = []
    with os.scandir(directory) as entries:
        for entry in entries:
            if MODEL_FILE.fullmatch(entry.name) or entry.name == JOURNAL:
                info = entry.stat(follow_symlinks=False)
                state.append((entry.name, info.st_ino, info.st_size, info.st_mtime_ns))
    return sorted(state)


def _wait_for_switch(directory) -> float:
    """Wait while a journal says a save's switch is in progress (at most READ_WAIT_SECONDS), then complete or undo
    a save whose writer died; the seconds waited."""
    start = time.monotonic()
    journal = os.path.join(directory, JOURNAL)
    while os.path.lexists(journal) and time.monotonic() - start < READ_WAIT_SECONDS:
        time.sleep(0.01)
    if os.path.lexists(journal):
        finish_interrupted_save(directory)
    return time.monotonic() - start


def load_consistently(directory, load):
    """`load()` (a `from_pretrained` of the folder) such that it returns one save's model, never a mix of two: it
    waits while a save is switching the folder's files, loads, and when the model files changed during the load (a
    save committed meanwhile) loads again holding the folder's save lock (waiting at most READ_WAIT_SECONDS for a
    running save to finish; no save switches files while it is held). Logs (warning) which model it returned when a
    save interfered. RuntimeError after READ_ATTEMPTS tries."""
    directory = os.path.abspath(os.fspath(directory))
    for attempt in range(1, READ_ATTEMPTS + 1):
        if attempt > 1:
            try:
                with _locked(directory, timeout=READ_WAIT_SECONDS):
                    if os.path.lexists(os.path.join(directory, JOURNAL)):
                        repair(directory)  # a writer that died mid-switch (a live one would hold the lock)
                    result = load()
                logger.warning("dat_hf: a save into %s committed while it was being loaded; loaded it again after "
                               "that save, holding the folder's save lock: this is the newest saved model.", directory)
                return result
            except OSError as error:
                if "has held its lock" not in str(error):
                    raise
                continue  # a long save holds the lock: try again without it
        waited = _wait_for_switch(directory)
        before = _files_state(directory)
        result = load()
        if _files_state(directory) == before and not any(name == JOURNAL for name, *_ in before):
            if waited > 0.05:
                logger.warning("dat_hf: waited %.2f s for a save into %s to commit; this is the new model.", waited,
                               directory)
            return result
    raise RuntimeError(f"Saves into {directory} changed its files during each of {READ_ATTEMPTS} loads and held its "
                       f"lock for more than {READ_WAIT_SECONDS:g} s each time; load it when no save is running.")


# ---- one save -------------------------------------------------------------------------------------------------------
def _commit(directory, staging):
    new = sorted(os.listdir(staging))
    if CONFIG not in new:
        raise RuntimeError(f"The save wrote no {CONFIG}; nothing to commit into {directory}.")
    existing = {name for name in os.listdir(directory) if os.path.isfile(os.path.join(directory, name))}
    old = sorted({name for name in existing if MODEL_FILE.fullmatch(name)} | (existing & set(new)))
    for name in new:
        _fsync_file(os.path.join(staging, name))
    fsync_dir(staging)
    backup = os.path.join(directory, BACKUP_PREFIX + os.path.basename(staging)[len(STAGING_PREFIX):])
    os.mkdir(backup)
    for name in old:
        _link_or_copy(os.path.join(directory, name), os.path.join(backup, name))
    fsync_dir(backup)
    journal = {"staging": os.path.basename(staging), "backup": os.path.basename(backup), "old": old, "new": new,
               "config_sha256": _sha256(os.path.join(staging, CONFIG))}
    _write_json(os.path.join(backup, JOURNAL), journal)  # the copy a damaged journal is repaired from
    fsync_dir(backup)
    _write_journal(directory, journal)
    _roll_forward(directory, journal)


def _journal_folder(directory, journal, key):
    """The staging or backup folder a journal names, refusing a symbolic link (never followed out of the folder)."""
    path = os.path.join(directory, journal[key])
    if os.path.islink(path):
        raise ValueError(f"{path} is a symbolic link where the interrupted save into {directory} keeps its "
                      f"{'staged files' if key == 'staging' else 'backup of the previous model'}; dat_hf does not "
                      f"follow it. Remove the link and put back the folder it replaced, or delete {path} and "
                      f"{os.path.join(directory, JOURNAL)} to keep the folder's files as they are.")
    return path


def _roll_forward(directory, journal):
    """New files in (config last: the commit point), old-only files out."""
    staging = _journal_folder(directory, journal, "staging")
    for name in [n for n in journal["new"] if n != CONFIG]:
        _move_if_present(os.path.join(staging, name), os.path.join(directory, name))
    for name in set(journal["old"]) - set(journal["new"]):
        _unlink_if_present(os.path.join(directory, name))
    fsync_dir(directory)
    _move_if_present(os.path.join(staging, CONFIG), os.path.join(directory, CONFIG))
    fsync_dir(directory)


def _roll_back(directory, journal):
    """New-only files out, old files back from the backup."""
    backup = _journal_folder(directory, journal, "backup")
    for name in set(journal["new"]) - set(journal["old"]):
        _unlink_if_present(os.path.join(directory, name))
    for name in journal["old"]:
        _move_if_present(os.path.join(backup, name), os.path.join(directory, name))
    fsync_dir(directory)


# ---- file operations ------------------------------------------------------------------------------------------------
@contextlib.contextmanager
def _locked(directory, timeout=None):
    """The folder's save lock (flock: released by the OS if its holder dies); waits at most `timeout` s (OSError)."""
    try:
        import fcntl
    except ImportError:  # not POSIX: no lock
        yield
        return
    fd = os.open(directory, os.O_RDONLY)
    try:
        if timeout is None:
            fcntl.flock(fd, fcntl.LOCK_EX)
        else:
            deadline = time.monotonic() + timeout
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    if time.monotonic() > deadline:
                        raise OSError(f"a save into {directory} has held its lock for more than {timeout:g} s") \
                            from None
                    time.sleep(0.001)  # short: a writer saving in a loop frees the lock only between its saves
        yield
    finally:
        os.close(fd)  # releases the lock


def _read_journal(directory):
    """The journal of an interrupted save (None without one); a damaged journal is replaced by the intact copy in
    its backup folder, else a ValueError names it and says what to do."""
    path = os.path.join(directory, JOURNAL)
    if os.path.islink(path):
        raise ValueError(f"{path} is a symbolic link, not a dat_hf save journal; it was not followed. Delete it (and "
                         f"any {STAGING_PREFIX}*/{BACKUP_PREFIX}* folders) if {os.path.join(directory, CONFIG)} and "
                         "its weights are the model you want.")
    if not os.path.isfile(path):
        return None
    try:
        return _parse_journal(path)
    except ValueError as damage:
        for name in sorted(os.listdir(directory)):
            copy = os.path.join(directory, name, JOURNAL)
            if name.startswith(BACKUP_PREFIX) and not os.path.islink(os.path.join(directory, name)) \
                    and os.path.isfile(copy) and not os.path.islink(copy):
                with contextlib.suppress(ValueError):
                    journal = _parse_journal(copy)
                    if journal["backup"] == name:
                        logger.warning("dat_hf: %s was damaged (%s); the interrupted save is repaired with the copy in "
                                       "%s.", path, damage, copy)
                        return journal
        backups = [n for n in os.listdir(directory) if n.startswith(BACKUP_PREFIX)]
        where = (f"the previous model's files are in {os.path.join(directory, backups[0])}: move them into "
                 f"{directory}, then delete {path}" if backups else f"delete {path}")
        raise ValueError(f"{damage}. The save into {directory} was interrupted and its journal cannot be repaired (no "
                         f"intact copy in a {BACKUP_PREFIX}* folder). To recover: {where} and every "
                         f"{STAGING_PREFIX}*/{BACKUP_PREFIX}* folder, then check that the folder loads.") from None


def _parse_journal(path):
    """A journal's fields, checked: ValueError naming the file and what is wrong."""
    try:
        with open(path, encoding="utf-8") as f:
            journal = json.load(f)
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ValueError(f"{path} is not a dat_hf save journal (not JSON: {error})") from None
    missing = [key for key in ("staging", "backup", "old", "new", "config_sha256")
               if not isinstance(journal, dict) or key not in journal]
    if missing:
        raise ValueError(f"{path} is not a complete dat_hf save journal (missing {', '.join(missing)})")
    if not isinstance(journal["old"], list) or not isinstance(journal["new"], list):
        raise ValueError(f"{path} is not a dat_hf save journal (`old` and `new` must be lists of file names)")
    names = [journal["staging"], journal["backup"], *journal["old"], *journal["new"]]
    # plain names inside the folder only: a journal that came from elsewhere must not reach outside it
    plain = all(isinstance(n, str) and n not in ("", ".", "..") and os.path.basename(n) == n and "/" not in n
                for n in names)
    if not plain or not journal["staging"].startswith(STAGING_PREFIX) or not journal["backup"].startswith(BACKUP_PREFIX):
        raise ValueError(f"{path} is not a dat_hf save journal (it names files outside the folder)")
    return journal


def _write_json(path, content):
    with open(path, "x", encoding="utf-8") as f:  # exclusive: never through a planted link
        json.dump(content, f)
        f.flush()
        os.fsync(f.fileno())


def _write_journal(directory, journal):
    tmp = os.path.join(directory, f"{JOURNAL}.tmp-{journal['staging'][len(STAGING_PREFIX):]}")
    _write_json(tmp, journal)
    os.replace(tmp, os.path.join(directory, JOURNAL))
    fsync_dir(directory)


def _sha256(path):
    if not os.path.isfile(path):
        return None
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _link_or_copy(source, target):
    try:
        os.link(source, target)
    except OSError:  # no hard links on this file system
        shutil.copy2(source, target)


def _move_if_present(source, target):
    if os.path.lexists(source):
        os.replace(source, target)


def _unlink_if_present(path):
    if os.path.lexists(path):
        os.unlink(path)


def _fsync_file(path):
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def fsync_dir(path):
    """Make renames in `path` durable (POSIX; directories cannot be opened for fsync on Windows)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


__all__ = ["save_atomically", "finish_interrupted_save", "load_consistently", "repair", "fsync_dir"]
