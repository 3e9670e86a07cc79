"""Train-state checkpoints with orbax: asynchronous saves every N steps, the last K kept.

Each step is written into a temporary folder and renamed into place only once complete (orbax's
atomic finalize), so a run killed mid-save leaves at worst a temporary folder, which is ignored
and cleaned up: restore always reads a finished checkpoint. Next to the state (params, optimizer
state, RNG) a small JSON item records the data position and the settings the run depends on, so
resuming under a different model or data layout is an error rather than a silent restart.
"""

from __future__ import annotations

from pathlib import Path

import orbax.checkpoint as ocp


class ResumeError(RuntimeError):
    """A checkpoint folder that cannot be resumed from: unreadable, damaged, or written by
    different settings."""


class Checkpoints:
    def __init__(self, directory, save_every: int, keep: int):
        self.dir = Path(directory).absolute()
        if self.dir.exists() and not self.dir.is_dir():
            raise ResumeError(f"checkpoint path {self.dir} exists and is not a folder")
        options = ocp.CheckpointManagerOptions(
            save_interval_steps=save_every, max_to_keep=keep, create=True,
            enable_async_checkpointing=True, cleanup_tmp_directories=True)
        try:
            self.manager = ocp.CheckpointManager(self.dir, options=options)
        except Exception as e:  # orbax raises several types for an unreadable folder
            raise ResumeError(f"cannot open checkpoint folder {self.dir}: {e}") from None

    def save(self, step: int, state, meta: dict, force: bool = False) -> bool:
        """Start saving `state` as `step` if the interval says so (or `force`); returns at once."""
        args = ocp.args.Composite(state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta))
        return self.manager.save(step, args=args, force=force)

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def restore(self, abstract_state, expect_meta: dict):
        """(state, meta) of the latest finished checkpoint placed on `abstract_state`'s
        shardings, or None when there is none. Settings in `expect_meta` must match."""
        step = self.latest_step()
        if step is None:
            return None
        where = self.dir / str(step)
        try:
            meta = self.manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))
            meta = meta["meta"]
        except Exception as e:
            raise ResumeError(f"checkpoint {where} has no readable metadata ({e}); delete "
                                    "that folder to resume from an earlier step") from None
        _check_meta(meta, expect_meta, where)
        try:
            restored = self.manager.restore(
                step, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract_state)))
        except Exception as e:
            raise ResumeError(f"checkpoint {where} cannot be restored ({type(e).__name__}: "
                                    f"{e}); delete that folder to resume from an earlier step"
                                    ) from None
        return restored["state"], meta

    def wait(self):
        """Block until the last asynchronous save is finalized."""
        self.manager.wait_until_finished()

    def close(self):
        self.manager.close()


def _check_meta(meta: dict, expect: dict, where: Path):
    for key, want in expect.items():
        if meta.get(key) != want:
            raise ResumeError(
                f"checkpoint {where} was written with {key}={meta.get(key)!r}, but this run has "
                f"{key}={want!r}; use another --out folder or the original settings")
