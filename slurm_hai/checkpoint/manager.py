"""CheckpointManager: the one public entry point for saving and resuming.

    mgr = CheckpointManager("/ckpt/run1", keep_last=3, fast_dir="/dev/shm/run1")
    mgr.load(into=training_state)               # newest valid checkpoint, or None
    h = mgr.save(step, training_state, blocking=False)
    mgr.wait()                                   # before exiting

Single process: tensors are copied into a reusable host buffer, then a background thread
writes, checksums and commits them (fast tier first, then the durable one).
Distributed (torch.distributed initialized, world size > 1): save() is collective; with
blocking=False each rank copies its tensors into host buffers and the DCP write, checksums
and rank 0's commit run in a background thread on every rank, over a gloo group of their
own (see sharded.py).

Inside a Slurm job the manager fences its run (commit.py, "the run fence"): it records at
start that this run of the job has started, and a run that a newer one has superseded (its
processes cut off from Slurm while the job was requeued elsewhere) commits nothing; its
save()/wait()/suspend_save() then raise SystemExit with one line, so that the process stops
even where the training loop goes on after a CheckpointError.
"""

from __future__ import annotations

import logging
import operator
import os
import secrets
import socket
import threading
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from .commit import CheckpointStore, RunId
from .errors import CheckpointError, CorruptCheckpointError, Problem, SupersededRunError
from .fileio import describe_os_error, write_hashed_file
from .layout import (STATE_FILE, ActiveStaging, checkpoint_versions, rank_file_name, read_rank_file,
                     read_single_checkpoint)
from .manifest import LAYOUT_DCP, LAYOUT_SINGLE, FileEntry, Manifest, parse_step_dir_name, read_manifest
from .manifest import PieceHasher
from .memory import (PartInfo, agent_alive, check_part_files, commit_part, file_request, forget_parts, mark_pending,
                     newest_part, node_name, parts_store, pending_steps, read_part, reserve_spares, spares_dir,
                     take_spare, wait_for_pending)
from .region import MappedRegion, state_file_plan, stream_tensor_file
from .serialize import flatten_state, is_stateful, unflatten_state
from .staging import HostBuffer, SaveHandle, StagedFile, run_in_background, stage_files

log = logging.getLogger(__name__)


def distributed_world() -> tuple[int, int] | None:
    """(rank, world size) when torch.distributed runs with more than one process."""
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        return dist.get_rank(), dist.get_world_size()
    return None


def current_rank() -> int:
    world = distributed_world()
    return world[0] if world else 0


def restore_into(target: Any, loaded: Any, where: str = "") -> None:
    """Hand loaded values to live objects: load_state_dict() for stateful objects, in-place
    copy for tensors, recursing through dicts/lists that mirror the saved structure."""
    if is_stateful(target):
        target.load_state_dict(loaded)
    elif isinstance(target, torch.Tensor):
        with torch.no_grad():
            target.copy_(loaded)
    elif isinstance(target, Mapping):
        if not isinstance(loaded, Mapping):
            raise CheckpointError(f"{where or '<root>'}: checkpoint holds a {type(loaded).__name__}, not a dict")
        for key, value in target.items():
            if key not in loaded:
                raise CheckpointError(f"{where}/{key}: not in the checkpoint; was it saved under another name?")
            restore_into(value, loaded[key], f"{where}/{key}")
    elif isinstance(target, (list, tuple)):
        for i, (value, item) in enumerate(zip(target, loaded, strict=True)):
            restore_into(value, item, f"{where}/{i}")


def checked_step(step: Any) -> int:
    try:
        step = operator.index(step)  # ints, numpy ints, 0-d integer tensors
    except TypeError:
        raise CheckpointError(f"step must be an integer, got {step!r}") from None
    if step < 0 or isinstance(step, bool):
        raise CheckpointError(f"step must be a non-negative integer, got {step!r}")
    return step


@contextmanager
def stop_if_superseded() -> Iterator[None]:
    """A run that a newer run of its job superseded must stop, not retry: SystemExit with
    the refusal's one line (a training loop that goes on after a CheckpointError still ends)."""
    try:
        yield
    except SupersededRunError as exc:
        log.error("%s", exc)
        raise SystemExit(f"slurm-hai: {exc}") from None


class CheckpointManager:
    """Atomic, verified, optionally async and two-tier checkpoints of one training run.

    directory: the durable tier (shared file system). fast_dir: optional node-local tier
    (e.g. /dev/shm/<job>), committed first and preferred when loading; it survives a
    process crash, not a requeue onto another node. keep_last / fast_keep_last: how many
    valid checkpoints each tier keeps. lock_timeout: how long a commit waits for
    DIR/.lock. stale_staging_age_s: when a silent staging dir of a writer on another
    host counts as abandoned.
    """

    def __init__(
        self,
        directory: str | os.PathLike[str],
        *,
        keep_last: int = 3,
        fast_dir: str | os.PathLike[str] | None = None,
        fast_keep_last: int = 1,
        lock_timeout: float = 300.0,
        stale_staging_age_s: float = 6 * 3600.0,
    ) -> None:
        if keep_last < 1 or fast_keep_last < 1:
            raise CheckpointError("keep_last and fast_keep_last must be at least 1 (the newest valid one is always kept)")
        self.keep_last = keep_last
        self.fast_keep_last = fast_keep_last
        store_args = {"lock_timeout": lock_timeout, "stale_staging_age_s": stale_staging_age_s}
        run = RunId.from_env()  # this run of the Slurm job, or None outside one
        self.durable = CheckpointStore(directory, run=run, lock_timeout=lock_timeout,
                                       stale_staging_age_s=stale_staging_age_s)
        # the fast tier is node-local: it checks the durable directory's record of runs
        self.fast = (CheckpointStore(fast_dir, run=run, fence_store=self.durable, lock_timeout=lock_timeout,
                                     stale_staging_age_s=stale_staging_age_s) if fast_dir is not None else None)
        with stop_if_superseded():
            self.durable.start_run()  # from now on, no older run of this job commits
        # suspend_save()'s node memory parts (memory.py): FAST/parts/
        self.parts = parts_store(Path(fast_dir), **store_args) if fast_dir is not None else None
        self.loaded_step: int | None = None  # the step the last load() returned
        self.loaded_from = ""  # and where from: "node memory", or the directory
        self._buffer = HostBuffer()
        self._tensor_buffer = HostBuffer()  # async sharded saves: host copies of the tensors
        self._group: Any = None  # async sharded saves: a gloo group for the background threads
        self._inflight: SaveHandle | None = None
        self._thread: threading.Thread | None = None
        self._active_staging = ActiveStaging()
        self._loading: set[int] = set()
        self._reserving: threading.Thread | None = None  # reserve_node_memory()'s
        self._stop_reserving = threading.Event()
        self._node_count: int | None = None
        self._region = MappedRegion()  # a single process's spare, mapped ahead and kept across saves
        if current_rank() == 0:
            for store in self.stores:
                store.clean_stale(self._active_staging.paths)
        if self.parts is not None:  # on every node
            self.parts.clean_stale(self._active_staging.paths)

    @property
    def stores(self) -> list[CheckpointStore]:
        """Fast tier first: it is written first and read first."""
        return [store for store in (self.fast, self.durable) if store is not None]

    @property
    def stores_to_read(self) -> list[CheckpointStore]:
        """Node memory parts (suspend saves of a single process), then the fast and durable tiers."""
        return ([self.parts] if self.parts is not None else []) + self.stores

    def _verify(self, store: CheckpointStore, path: Path) -> list[Problem]:
        if store is not self.parts:
            return store.verify(path).problems
        try:
            part = read_part(path)
        except CorruptCheckpointError as exc:
            return exc.problems
        if part.nodes != 1 or part.manifest.world_size != 1:
            return [Problem("part.json", "one node's share of a multi-process checkpoint: load it with every rank")]
        return check_part_files(path, part, sorted(part.manifest.files))

    def _keep_for(self, store: CheckpointStore) -> int:
        return self.fast_keep_last if store is self.fast else self.keep_last

    # --- saving -------------------------------------------------------------------

    def save(self, step: int, state: Any, *, blocking: bool = True) -> SaveHandle:
        with stop_if_superseded():
            return self._save(step, state, blocking=blocking)

    def _save(self, step: int, state: Any, *, blocking: bool = True) -> SaveHandle:
        """Save state as checkpoint `step`. blocking=True returns once committed to every
        tier; blocking=False returns once the tensors are copied to host memory (call
        wait() or h.wait()). A step that is already committed is skipped with a warning.

        In a distributed job (world size > 1) every rank must call save(); it is a
        collective DCP save into the durable tier (see sharded.py). With blocking=False
        it returns after the host copy; rank 0 commits once every rank's files are
        written and checksummed, and a failure on any rank is raised by the next
        save/wait/load/close on every rank. handle.skipped is known once it is done."""
        step = checked_step(step)
        self.wait()  # at most one save in flight; raises the previous save's failure
        self.reserve_node_memory(state)
        if (world := distributed_world()) is not None:
            if not blocking:
                return self._save_sharded_async(step, state, rank=world[0])
            return self._save_sharded(step, state, rank=world[0])
        handle = SaveHandle(step)
        targets = self._stores_missing(step)
        if not targets:
            log.warning("step %d is already committed; not saving it again (checkpoints are immutable)", step)
            handle.skipped = True
            handle.finish()
            return handle
        staged = stage_files(self._single_files(state), self._buffer)
        self._inflight = handle
        self._thread = run_in_background(
            handle, lambda: self._persist(step, staged, targets, handle), lambda: self.housekeeping(targets)
        )
        if blocking:
            self.wait()
        return handle

    def reserve_node_memory(self, state: Any, *, wait: bool = False) -> None:
        """Reserve ahead, in the background, the node memory a suspend_save() of `state` will
        write into (a distributed job with fast_dir): the save then overwrites pages that are
        already there, about three times faster than faulting in new ones. Memory that a
        part already committed to the durable tier holds is reused. save() and load(into=)
        call it; call it after building the model when the job makes no save before its first
        suspend notice. Collective with world size > 1, like save(). wait: return once the
        memory is reserved (it takes a while for a large save: every page is written once)."""
        if self.parts is None:
            return
        from .node_memory import spare_sizes  # lazy: +600 ms (DCP) to a saving script

        world = distributed_world() or (0, 1)
        if self._node_count is None:  # once: the only collective here

            nodes: list[Any] = [node_name()] * world[1]
            if world[1] > 1:
                dist.all_gather_object(nodes, node_name(), group=self._checkpoint_group())
            self._node_count = len(set(nodes))
        if self._reserving is not None and self._reserving.is_alive():
            if wait:
                self._reserving.join()
            return
        if not agent_alive():
            return
        try:
            flat = flatten_state(state)[0]
            plan = state_file_plan(flat) if world[1] == 1 else None
        except Exception as exc:  # noqa: BLE001 - the save reports a state it cannot flatten
            log.debug("not reserving node memory: %r", exc)
            return
        # a single process: exactly its state file, mapped ahead (the save writes into the mapping)
        sizes = {"own-0": plan[2]} if plan is not None else spare_sizes(flat.tensors, world[0], world[1],
                                                                         self._node_count > 1)
        parts, durable, stop, region = self.parts, self.durable, self._stop_reserving, self._region

        def reserve() -> None:
            reserve_spares(parts, durable, sizes, stop=stop)
            if plan is not None and not stop.is_set():
                region.prepare(spares_dir(parts) / "own-0", plan[2])

        self._reserving = threading.Thread(target=reserve, name="hai-reserve-node-memory", daemon=True)
        self._reserving.start()
        if wait:
            self._reserving.join()

    def suspend_save(self, step: int, state: Any, *, peer_copy: bool = True) -> SaveHandle:
        """The save to make at a suspend notice, before go_suspend(): it commits `step` to
        the memory of every node of the job (fast_dir, node-local) and returns; the node's
        persist agent (`hai-admin persist-agent`) then copies it to the durable directory,
        after the job has let go of its nodes. A restart on the same nodes loads it from
        memory; a restart elsewhere waits for the agents' commit. Collective with world
        size > 1. Without fast_dir, or without a persist agent on every node, it is a
        blocking save to the durable directory (with a warning). The handle is done.
        peer_copy: also keep each node's share in the next node's memory (several nodes), so
        that one node lost before the durable commit costs nothing; it adds a network copy of
        each node's share to the save (docs/checkpoint.md, "The window")."""
        step = checked_step(step)
        with stop_if_superseded():
            self.wait()
            handle = self._suspend_save(step, state, peer_copy)
        in_memory = self.parts is not None and self.parts.step_path(step).exists() and not handle.skipped
        handle.where = "node memory" if in_memory else str(self.durable.root)
        try:
            handle.nbytes = (read_part(self.parts.step_path(step)).manifest if in_memory and self.parts is not None
                             else read_manifest(self.durable.step_path(step))).total_bytes
        except CheckpointError:
            pass  # only informative
        return handle

    def _suspend_save(self, step: int, state: Any, peer_copy: bool) -> SaveHandle:
        with self.durable.locked():  # node memory is not a store commit: the fence is checked here
            self.durable.check_fence()
        if (world := distributed_world()) is not None:
            from .node_memory import save_to_memory  # lazy: +600 ms (DCP) to a saving script
            from .sharded import prepare_share  # lazy: +600 ms (DCP) to a saving script

            share = prepare_share(state, self._buffer, None)
            skipped = None
            if self.parts is not None:
                skipped = save_to_memory(self.parts, self.durable, step, share, active_staging=self._active_staging,
                                         group=self._checkpoint_group(), peer_copy=peer_copy)
            if skipped is None:
                return self._save_sharded(step, state, rank=world[0])
            handle = SaveHandle(step)
            handle.skipped = skipped
            handle.finish()
            return handle
        if self.parts is None or not agent_alive():
            log.warning("%s: saving step %d to %s directly", "no fast_dir" if self.parts is None else
                        f"no persist agent on {node_name()}", step, self.durable.root)
            return self.save(step, state)
        handle = SaveHandle(step)
        existing = self.durable.step_path(step)
        if existing.exists() and self.durable.verify(existing).ok:
            handle.skipped = True
            handle.finish()
            return handle
        files = self._single_files(state)
        plan = state_file_plan(files[0][1])
        staged = stage_files(files if plan is None else files[1:], self._buffer)
        staging = self.parts.new_staging(step)
        self._active_staging.add(staging)
        try:
            take_spare(spares_dir(self.parts), "own-0", staging / STATE_FILE)  # pages reserved ahead, if any
            entries = {f.name: write_hashed_file(staging / f.name, f.image, over_spare=True, hasher=PieceHasher())
                       for f in staged}
            if plan is not None:  # the tensors straight into the (mapped) spare, pieces hashed in parallel
                entries[STATE_FILE] = self._region.write(staging / STATE_FILE, *plan)
            part = PartInfo(step, secrets.token_hex(4), node_name(), 0, 1, str(self.durable.root), sorted(entries),
                            self._single_manifest(step, entries))
            file_request(commit_part(self.parts, staging, part), part)
        except OSError as exc:
            raise describe_os_error(exc, f"writing step {step} to node memory {self.parts.root}") from exc
        finally:
            self._active_staging.release(self.parts, staging)
        mark_pending(self.durable, step, [part.node])
        handle.finish()
        return handle

    def wait(self) -> None:
        """Block until the in-flight save (if any) is committed; raise its failure once."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._inflight is not None:
            handle, self._inflight = self._inflight, None
            with stop_if_superseded():
                handle.raise_error()

    def close(self) -> None:
        """Wait for the in-flight save (raising its failure) and let go of the checkpoint
        process group. Call it (or wait()) before destroying the process group."""
        self.wait()
        if self._reserving is not None:  # at most one spare being written: it is finished
            self._stop_reserving.set()
            self._reserving.join()
            self._reserving = None
            self._stop_reserving = threading.Event()
        self._region.release()
        self._group = None

    def _checkpoint_group(self) -> Any:
        """The gloo group of the background threads of async sharded saves, made on the
        first one (new_group is collective; so is save()). Its own group, so that the
        background collectives never interleave with the training's on the default group,
        and gloo, so that they run on the CPU whatever the training's backend."""
        if self._group is None:
            self._group = dist.new_group(backend="gloo")
        return self._group

    def _save_sharded_async(self, step: int, state: Any, *, rank: int) -> SaveHandle:
        from .sharded import persist_sharded, prepare_share  # lazy: +600 ms (DCP) to a saving script

        group = self._checkpoint_group()
        share = prepare_share(state, self._buffer, self._tensor_buffer)  # the blocking part: host copies
        handle = SaveHandle(step)

        def persist() -> None:
            handle.skipped = persist_sharded(
                self.durable, step, share, active_staging=self._active_staging, group=group
            )

        def tidy() -> None:
            if rank == 0 and not handle.skipped and handle._error is None:  # after finish()
                self.housekeeping([self.durable])

        self._inflight = handle
        self._thread = run_in_background(handle, persist, tidy)
        return handle

    def _save_sharded(self, step: int, state: Any, *, rank: int) -> SaveHandle:
        from .sharded import save_sharded  # lazy: +600 ms (DCP) to a saving script

        handle = save_sharded(self.durable, step, state, buffer=self._buffer, active_staging=self._active_staging)
        if rank == 0 and not handle.skipped:
            self.housekeeping([self.durable])
        return handle

    def _stores_missing(self, step: int) -> list[CheckpointStore]:
        """Tiers that still need this step; a bad existing copy is quarantined first."""
        missing = []
        for store in self.stores:
            path = store.step_path(step)
            if path.exists():
                result = store.verify(path)
                if result.ok:
                    continue
                store.quarantine(path, "; ".join(str(p) for p in result.problems))
            missing.append(store)
        return missing

    def _persist(self, step: int, staged: list[StagedFile], targets: list[CheckpointStore], handle: SaveHandle) -> None:
        known: dict[str, FileEntry] = {}  # checksums from the first tier, reused for the next
        fast_error: CheckpointError | None = None
        for store in targets:
            try:
                known, committed = self._write_tier(store, step, staged, known)
                if store is self.durable and not committed:
                    handle.skipped = True  # another writer committed the step first: it is kept
            except CheckpointError as exc:
                if store is not self.fast:
                    raise
                # The fast tier only speeds up restarts: a full /dev/shm must not cost the
                # durable checkpoint. Persist it, then report the fast-tier failure.
                log.error("fast tier save of step %d failed, persisting to %s anyway: %s", step, self.durable.root, exc)
                fast_error = exc
            handle.mark_first_tier_done()
        if fast_error is not None:
            raise CheckpointError(
                f"step {step} is committed in {self.durable.root}, but the fast tier failed: {fast_error} "
                "(the fast tier is optional: free space there or pass fast_dir=None)"
            ) from fast_error

    @staticmethod
    def _single_files(state: Any) -> list[tuple[str, Any]]:
        global_part, rank_part = flatten_state(state)
        files = [(STATE_FILE, global_part)]
        if rank_part is not None:
            files.append((rank_file_name(0), rank_part))
        return files

    @staticmethod
    def _write_files(staging: Path, staged: list[StagedFile], known: dict[str, FileEntry],
                     over_spare: bool = False) -> dict[str, FileEntry]:
        return {f.name: write_hashed_file(staging / f.name, f.image, known=known.get(f.name), over_spare=over_spare)
                for f in staged}

    @staticmethod
    def _single_manifest(step: int, entries: dict[str, FileEntry]) -> Manifest:
        return Manifest(step=step, layout=LAYOUT_SINGLE, world_size=1, files=entries,
                        versions=checkpoint_versions(), created_by={"host": socket.gethostname(), "pid": os.getpid()})

    def _write_tier(
        self, store: CheckpointStore, step: int, staged: list[StagedFile], known: dict[str, FileEntry]
    ) -> tuple[dict[str, FileEntry], bool]:
        """Write and commit the step to one tier: the files' entries, and whether this commit
        made it (False: the step was committed there meanwhile, and that one is kept)."""
        staging = store.new_staging(step)
        self._active_staging.add(staging)
        try:
            entries = self._write_files(staging, staged, known)
            committed = store.commit(staging, self._single_manifest(step, entries)) is not None
        except OSError as exc:
            raise describe_os_error(exc, f"writing step {step} to {store.root}") from exc
        finally:
            self._active_staging.release(store, staging)
        return entries, committed

    def housekeeping(self, stores: list[CheckpointStore]) -> None:
        """Retention and stale-staging cleanup; never fails a save, only logs."""
        for store in stores:
            try:
                store.clean_stale(self._active_staging.paths)
                store.apply_retention(self._keep_for(store), protected=set(self._loading))
            except (OSError, CheckpointError) as exc:
                log.error("checkpoint housekeeping in %s failed: %s", store.root, exc)

    # --- finding and loading ----------------------------------------------------------

    def _candidates(self, step: int | None = None) -> Iterator[tuple[int, CheckpointStore, Path]]:
        """(step, store, path), newest step first: a node memory part, then the fast tier, then
        the durable one at equal step. A suspend checkpoint newer than any here that the
        agents are still persisting is waited for first."""
        if step is None and self.parts is not None and current_rank() == 0:
            newest = newest_part(self.parts)
            if newest is None or newest[0] < max(pending_steps(self.durable), default=-1):
                wait_for_pending(self.durable)
        found = []
        for order, store in enumerate(self.stores_to_read):
            for found_step, path in store.steps().items():
                if step is None or found_step == step:
                    found.append((-found_step, order, store, path))
        found.sort(key=lambda item: (item[0], item[1]))
        for neg_step, _, store, path in found:
            yield -neg_step, store, path

    def latest_step(self) -> int | None:
        """Newest committed checkpoint (any tier) whose files verify; bad ones are quarantined."""
        if distributed_world() is not None:
            from .sharded import broadcast_from_rank0  # lazy: +600 ms (DCP) to a saving script

            return broadcast_from_rank0(self._latest_step_local if current_rank() == 0 else None)
        return self._latest_step_local()

    def _latest_step_local(self) -> int | None:
        for step, store, path in self._candidates():
            problems = self._verify(store, path)
            if not problems:
                return step
            if path.exists():
                store.quarantine(path, "; ".join(str(p) for p in problems))
        return None

    def load(self, step: int | None = None, *, into: Any = None) -> Any:
        """The newest valid checkpoint's state (or `step`'s), falling back past bad ones,
        which are quarantined. Returns None when there is no checkpoint at all.

        into: live objects mirroring the saved structure (a TrainingState, or a dict of
        model/optimizer/...): each stateful object gets load_state_dict(), tensors are
        copied in place. Tensors come back on the CPU.
        """
        self.wait()
        if distributed_world() is not None:
            from .node_memory import load_from_memory  # lazy: +600 ms (DCP) to a saving script
            from .sharded import load_distributed  # lazy: +600 ms (DCP) to a saving script

            group = self._checkpoint_group()
            found = None
            if self.parts is not None:
                found = load_from_memory(self.parts, self.durable, step, into, group)
                if found is None and step is None and current_rank() == 0:
                    wait_for_pending(self.durable)
            where = "node memory" if found is not None else str(self.durable.root)
            if found is None:
                found = load_distributed(self.durable, step, into, group=group)
            if found is None:
                return None
            self.loaded_from = where
            self.loaded_step, state = found
            self._forget_parts()
            if into is not None:
                restore_into(into, state)
                self.reserve_node_memory(into)
            return state
        overwritten = None  # a streamed load into the live tensors that failed halfway
        for found_step, store, path in self._candidates(step):
            self._loading.add(found_step)
            try:
                state = self._read(store, path, into)
            except CorruptCheckpointError as exc:
                if getattr(exc, "into_touched", False):
                    overwritten = path
                store.quarantine(path, "; ".join(str(p) for p in exc.problems))
                continue
            except CheckpointError as exc:
                log.warning("skipping checkpoint %s: %s", path, exc)
                continue
            finally:
                self._loading.discard(found_step)
            self.loaded_step = found_step
            self.loaded_from = "node memory" if store is self.parts else str(store.root)
            self._forget_parts()
            log.info("loaded checkpoint %s", path)
            if into is not None:
                restore_into(into, state)
                self.reserve_node_memory(into)
            return state
        if overwritten is not None:
            raise CheckpointError(f"{overwritten} failed verification while it was read into the live tensors and "
                                  "no other checkpoint loaded over them: they are partly overwritten; rebuild them "
                                  "before training on")
        if step is not None:
            dirs = ", ".join(str(s.root) for s in self.stores)
            raise CheckpointError(f"no valid checkpoint for step {step} in {dirs}; `hai ckpt ls` lists what exists")
        return None

    def _forget_parts(self) -> None:
        if self.parts is not None and self.loaded_step is not None:
            forget_parts(self.parts, older_than=self.loaded_step)

    @staticmethod
    def _stream_into(path: Path, manifest: Manifest, into: Any) -> Any:
        """A part's state file read straight into the live tensors of `into` (region.py),
        or None when its tensors do not match them (then read the usual way)."""
        try:
            targets = flatten_state(into)[0].tensors
        except CheckpointError:
            return None
        try:
            flat = stream_tensor_file(path / STATE_FILE, manifest.files[STATE_FILE], STATE_FILE, targets)
        except CorruptCheckpointError as exc:
            exc.into_touched = True  # type: ignore[attr-defined]
            raise
        if flat is None:
            return None
        return unflatten_state(flat.tree, flat.tensors, read_rank_file(path, manifest, 0))

    def _read(self, store: CheckpointStore, path: Path, into: Any) -> Any:
        if store is self.parts:  # verified as it is read, like any checkpoint
            part = read_part(path)
            if part.nodes != 1 or part.manifest.world_size != 1:
                raise CheckpointError(f"{path} is one node's share of a multi-process checkpoint")
            if into is not None and STATE_FILE in part.manifest.files:
                streamed = self._stream_into(path, part.manifest, into)
                if streamed is not None:
                    return streamed
            return read_single_checkpoint(path, part.manifest, rank=0)
        try:
            manifest = read_manifest(path)
        except CheckpointError as exc:
            raise CorruptCheckpointError(str(path), [Problem("manifest.json", str(exc))]) from None
        if manifest.step != parse_step_dir_name(path.name):
            raise CorruptCheckpointError(
                str(path), [Problem("manifest.json", f"says step {manifest.step}, directory says otherwise")]
            )
        if manifest.layout == LAYOUT_DCP:
            from .sharded import read_dcp_checkpoint  # lazy: +600 ms (DCP) to a saving script

            result = store.verify(path)
            if not result.ok:
                raise CorruptCheckpointError(str(path), result.problems)
            return read_dcp_checkpoint(path, manifest, rank=0, into=into)
        return read_single_checkpoint(path, manifest, rank=current_rank())
