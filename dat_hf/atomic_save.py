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
(which also runs as remote code): if `config.json` is the new one (its hash is in the journal) the save is rolled
forward (new files moved in, old-only files removed), else rolled back (old files restored from the backup, new-only
files removed). Either way the weights agree with the `config.json` that the Auto classes read before the model
class runs. Staging or backup folders without a journal are leftovers of a save stopped before step 3: deleted.

Files other than the model's (tokenizer, processor, model card, metrics) are never moved or deleted. A directory swap
(`renameat2(RENAME_EXCHANGE)`) would also be atomic for readers that do not repair, but it needs a writable parent,
is Linux-only and would swap those other files away; the journal works the same everywhere. Saves into one folder
are serialized by an advisory lock on the folder (POSIX); a reader running during a save is not protected.
"""

import contextlib
import hashlib
import json
import os
import re
import shutil
import tempfile

STAGING_PREFIX = ".dat_hf_staging-"
BACKUP_PREFIX = ".dat_hf_backup-"
JOURNAL = ".dat_hf_commit.json"
CONFIG = "config.json"
# Transformers' files of one model: configs and weights in any layout (single file, shards, index, variants, .bin)
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
        with _locked(directory):
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
        if name.startswith((STAGING_PREFIX, BACKUP_PREFIX)) and os.path.isdir(path):
            shutil.rmtree(path)
        elif name.startswith(JOURNAL + ".tmp"):
            os.unlink(path)


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
    _write_journal(directory, journal)
    _roll_forward(directory, journal)


def _roll_forward(directory, journal):
    """New files in (config last: the commit point), old-only files out."""
    staging = os.path.join(directory, journal["staging"])
    for name in [n for n in journal["new"] if n != CONFIG]:
        _move_if_present(os.path.join(staging, name), os.path.join(directory, name))
    for name in set(journal["old"]) - set(journal["new"]):
        _unlink_if_present(os.path.join(directory, name))
    fsync_dir(directory)
    _move_if_present(os.path.join(staging, CONFIG), os.path.join(directory, CONFIG))
    fsync_dir(directory)


def _roll_back(directory, journal):
    """New-only files out, old files back from the backup."""
    backup = os.path.join(directory, journal["backup"])
    for name in set(journal["new"]) - set(journal["old"]):
        _unlink_if_present(os.path.join(directory, name))
    for name in journal["old"]:
        _move_if_present(os.path.join(backup, name), os.path.join(directory, name))
    fsync_dir(directory)


# ---- file operations ------------------------------------------------------------------------------------------------
@contextlib.contextmanager
def _locked(directory):
    try:
        import fcntl
    except ImportError:  # not POSIX: no lock
        yield
        return
    fd = os.open(directory, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the lock


def _read_journal(directory):
    path = os.path.join(directory, JOURNAL)
    if not os.path.isfile(path):
        return None
    with open(path, encoding="utf-8") as f:
        journal = json.load(f)
    names = [journal["staging"], journal["backup"], *journal["old"], *journal["new"]]
    # plain names inside the folder only: a journal that came from elsewhere must not reach outside it
    plain = all(isinstance(n, str) and n not in ("", ".", "..") and os.path.basename(n) == n and "/" not in n
                for n in names)
    if not plain or not journal["staging"].startswith(STAGING_PREFIX) or not journal["backup"].startswith(BACKUP_PREFIX):
        raise ValueError(f"{path} is not a dat_hf save journal.")
    return journal


def _write_journal(directory, journal):
    tmp = os.path.join(directory, f"{JOURNAL}.tmp-{journal['staging'][len(STAGING_PREFIX):]}")
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(journal, f)
        f.flush()
        os.fsync(f.fileno())
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


__all__ = ["save_atomically", "finish_interrupted_save", "repair", "fsync_dir"]
