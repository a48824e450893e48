"""Weight updates: new weights copied into a serving engine in place, from a checkpoint or
a trainer's tensors (SGLang's /update_weights_from_disk and _from_distributed, its weight
update groups), as `Engine`'s mixin."""

from __future__ import annotations

import contextlib
import logging
import uuid
from dataclasses import replace
from pathlib import Path
from typing import Any, NoReturn

import torch

from dsakv.config import ModelConfig
from dsakv.config.model import served_sampling_defaults
from dsakv.distributed import weight_sync
from dsakv.distributed.weight_sync import GroupUpdate, TensorUpdate, WeightGroup
from dsakv.errors import DsakvError, is_int
from dsakv.memory.storage import storage_namespace

from .ranks import by_rank, gather_outcome, said
from .sampling import SamplingParams

log = logging.getLogger(__name__)


# This mixin's calls that every rank runs (`Engine.every_rank_call`)
WEIGHT_CALLS = (
    "update_weights_here",
    "drop_update_here",
    "join_weight_group_here",
    "leave_weight_group_here",
    "weights_by_name_here",
)


class WeightUpdateMixin:
    """`Engine`'s weight updates. Its host holds the weights (`model`, `model_config`,
    `weights_path`, `_stored`: how they load; `config`: the generation config they are
    served with) on `device`, `weight_groups`, what names them (`model_identity`, a cached
    property dropped here; with `layout` and `compute`, L3's namespace) and what holds their
    stop tokens (`_grammars`, set to None here); what an update drops or moves (`cache`,
    `l3`) and the sleep state (`released`; `_note_loaded`: `SleepMixin`); says whether
    requests keep an update off (`_busy`, `has_unfinished`) and runs calls on every rank
    (`_on_every_rank`, `parallel`)."""

    def update_weights(self, source: str | Path | GroupUpdate | TensorUpdate) -> bool:
        """SGLang's /update_weights_from_disk (`source` a checkpoint path: the served
        architecture, its weights stored as the served ones) and
        /update_weights_from_distributed (a `GroupUpdate`: named tensors a trainer
        broadcasts over a group `join_weight_group` joined; a `TensorUpdate`: named tensors
        this process holds), copied into the model in place
        (`update_weights_here`: a refused update changes nothing, the prefix cache included;
        a checkpoint that fails to load part way leaves the weights served), and L3 moved to
        the new weights' namespace. The prefix cache, whose KV the old weights computed, is
        dropped once the update passed its checks (a `GroupUpdate` may keep it). Only with
        nothing running or waiting (False, nothing loaded), unless `paused`: then what the
        requests hold stays (SGLang's), they go on with the new weights, and only the
        cache's unlocked pages are dropped. Under `--tp` every rank loads its own slices;
        under DP attention `DPEngine` runs this with its own `_busy` (every rank's requests)
        and `_on_every_rank`."""
        self.refuse_if_released(source)
        if self._busy():
            return False
        if self.l3 is not None and self.has_unfinished():  # (paused)
            self.refuse_update(
                source,
                "with the L3 tier a weight update does not run under paused requests: their "
                "pages would be stored under the new weights' namespace (pause with mode "
                "abort, or continue generation first)",
            )
        if not isinstance(source, (GroupUpdate, TensorUpdate)):
            source = str(source)
        return updated(self._on_every_rank("update_weights_here", source))

    def refuse_update(self, source: str | Path | GroupUpdate | TensorUpdate, why: str) -> NoReturn:
        """Refuse an update with `why`; a trainer's is received first on every rank, and
        dropped: it broadcasts once whatever the answer, and an update left unreceived
        would be the next one's tensors."""
        if isinstance(source, GroupUpdate):
            self._on_every_rank("drop_update_here", source)
        raise DsakvError(why)

    def refuse_if_released(self, source: str | Path | GroupUpdate | TensorUpdate) -> None:
        """Refuse an update while the weights are released (sleep mode): they have no memory
        to be copied into."""
        if "weights" in self.released:
            self.refuse_update(source, _RELEASED_WEIGHTS)

    def drop_update_here(self, update: GroupUpdate) -> None:
        """Receive a trainer's update and drop it (where it can be received at all)."""
        joined = self.weight_groups.get(update.group_name)
        if joined is None:
            return
        with contextlib.suppress(DsakvError):  # (metadata that cannot be: nothing was sent)
            weight_sync.receive(joined[1], update, joined[0].backend, self.device)

    def join_weight_group(self, spec: WeightGroup) -> None:
        """SGLang's /init_weights_update_group: every rank joins the trainer's group (rank
        `spec.rank_offset` + its own), waiting for the trainer and each other (up to
        `weight_sync.JOIN_TIMEOUT`); a group no rank could join is left by all."""
        spec.check(self.parallel.world_size, self.device)
        outcome = self._on_every_rank("join_weight_group_here", spec)
        if outcome is not None:
            raise DsakvError(outcome)

    def leave_weight_group(self, name: str) -> None:
        """SGLang's /destroy_weights_update_group, on every rank."""
        if name not in self.weight_groups:
            raise DsakvError(f"no weight update group {name!r}")
        self._on_every_rank("leave_weight_group_here", name)

    def get_weights_by_name(self, name: str, truncate_size: int = 100) -> list:
        """SGLang's /get_weights_by_name: the first `truncate_size` rows of checkpoint tensor
        `name` (the name updates take) as the engine holds it, as fp32 nested lists: every
        rank's slices and experts put together (under DP attention too: one tensor),
        FP8 blocks dequantized. For a trainer to compare what it sent with what is served."""
        if not is_int(truncate_size) or truncate_size < 0:
            raise DsakvError(f"truncate_size must be an integer >= 0, got {truncate_size!r}")
        if "weights" in self.released:
            raise DsakvError(_RELEASED_WEIGHTS)
        outcome = self._on_every_rank("weights_by_name_here", name, truncate_size)
        if isinstance(outcome, str):
            raise DsakvError(outcome)
        return outcome.tolist()

    def weights_by_name_here(self, name: str, rows: int) -> torch.Tensor | str | None:
        """This rank's slices of `name`, gathered on rank 0: the tensor there (each rank's
        error, if any failed), None elsewhere."""
        from dsakv.models import loader

        held, why = None, None
        try:
            held = loader.held_rows(self.model, name, rows)
        except Exception as e:  # noqa: BLE001 - rank 0 tells it
            why = said(e)
        shares = self.parallel.gather_objects((why, held))
        if shares is None:
            return None
        if any(w for w, _ in shares):
            return by_rank([w for w, _ in shares])
        return loader.first_rows([h for _, h in shares], rows)

    def join_weight_group_here(self, spec: WeightGroup) -> str | None:
        """This rank joins `spec`'s group; every rank then hears whether all did (None), or
        each one's error, and those that joined leave."""
        why = None
        try:
            if spec.group_name in self.weight_groups:
                raise DsakvError(f"weight update group {spec.group_name!r} exists already")
            group = weight_sync.join(spec, spec.rank_offset + self.parallel.rank)
            self.weight_groups[spec.group_name] = (spec, group)
        except Exception as e:  # noqa: BLE001 - every rank hears it
            why = said(e)
        outcome = gather_outcome(self.parallel, None, why)
        if not isinstance(outcome, str):
            return None
        if why is None:
            self.leave_weight_group_here(spec.group_name)
        return outcome

    def leave_weight_group_here(self, name: str) -> None:
        _, group = self.weight_groups.pop(name)
        weight_sync.leave(group)

    def update_weights_here(self, source: str | GroupUpdate | TensorUpdate) -> bool | str:
        """This rank's part of a weight update on every rank, run by each between steps
        (`every_rank_call`). Each phase's outcome is all-gathered, so every rank takes the same
        decision: (1) each rank, idle, checks the update against the slices it reads (a
        checkpoint: `loader.check_update`, its own experts' files; a group's tensors:
        received first, then `loader.check_tensors`; tensors given: that check); (2) only
        if every rank passed does each drop its prefix cache and copy its slices in; (3) if
        any rank's checkpoint read
        failed part way, every rank that touched its weights reloads the previous
        checkpoint, so that all ranks serve the same weights. Returns, alike on every rank,
        True (updated), False (a rank was busy: nothing loaded, nothing received) or what
        failed (nothing loaded, or rolled back, or the weights are mixed)."""
        from dsakv.models import loader

        previous = self.weights_path
        grouped = isinstance(source, GroupUpdate)
        named = isinstance(source, (GroupUpdate, TensorUpdate))  # (not a checkpoint)
        checked: Any = None
        why = None
        if self._busy():  # (under --tp rank 0 holds the requests, and `paused`)
            why = _BUSY
        else:
            try:
                if grouped:
                    if source.group_name not in self.weight_groups:
                        raise DsakvError(f"no weight update group {source.group_name!r}")
                    source.check()
                elif isinstance(source, TensorUpdate):
                    checked = loader.check_tensors(self.model, list(source.tensors))
                else:
                    checked = loader.check_update(self.model, source, **self._stored)
                    self._served(checked.config)
            except Exception as e:  # noqa: BLE001 - every rank hears it: none loads
                why = said(e)
        whys = self.parallel.all_gather_objects(why)
        if _BUSY in whys:
            return False
        if any(whys):
            return by_rank(whys)
        if grouped:  # every rank receives: the trainer sends once
            try:
                spec, group = self.weight_groups[source.group_name]
                tensors = weight_sync.receive(group, source, spec.backend, self.device)
                checked = loader.check_tensors(self.model, tensors)
            except Exception as e:  # noqa: BLE001 - every rank hears it: none loads
                why = said(e)
            received = gather_outcome(self.parallel, None, why)
            if isinstance(received, str):
                return received
        failed, touched = None, False
        try:
            # First, so that L3 writes every old page under the old weights' namespace.
            # Paused requests keep their pages, out of the cache's reach (`retire`).
            if not named or source.flush_cache:
                self.cache.retire()
            if self.l3 is not None and not self.l3.drain():
                raise DsakvError("L3 storage did not take the old pages in time")
            touched = True
            if named:
                loader.load_tensors(checked)
            else:
                loader.load_update(self.model, checked)
        except Exception as e:  # noqa: BLE001 - every rank hears it: all roll back
            failed = said(e)
        loaded = gather_outcome(self.parallel, None, failed)
        if not isinstance(loaded, str):
            self._weights_updated(source, checked)
            return True
        what = f"loading {_named(source)} failed part way ({loaded})"
        if named:  # (nothing on disk to go back to)
            return f"{what}: the weights are mixed, update them again"
        again = None
        if touched:
            try:
                loader.reload_weights(self.model, previous)
            except Exception as e:  # noqa: BLE001 - told below: the weights are mixed
                again = said(e)
        reloaded = gather_outcome(self.parallel, None, again)
        if isinstance(reloaded, str):
            return (
                f"{what}, and reloading {previous} failed too ({reloaded}): the "
                "weights are mixed, restart the server"
            )
        self._note_loaded(None if touched else [])  # (discarded weights: all back, reloaded)
        return f"{what}; every rank serves {previous} again"

    def _served(self, model_config: ModelConfig) -> ModelConfig:
        """`model_config` as served: generation_config.json's sampling defaults (what
        requests leave out; one that is bad would fail each of them) checked, or dropped
        under --generation-config vllm, with --override-generation-config's over them."""
        c = self.config
        defaults = served_sampling_defaults(
            model_config.sampling_defaults, c.generation_config, c.override_generation_config
        )
        if defaults:
            SamplingParams(**defaults)
        if defaults == model_config.sampling_defaults:
            return model_config
        return replace(model_config, sampling_defaults=defaults)

    def _weights_updated(
        self, source: str | GroupUpdate | TensorUpdate, checked: Any = None
    ) -> None:
        if isinstance(source, str):
            self.weights_path = source  # (what a failed update later goes back to)
            # The checkpoint's token ids and sampling defaults, as a fresh engine's (the
            # grammars' stop tokens with them).
            from dsakv.models.loader import TOKEN_FIELDS

            served = self._served(checked.config)
            self.model_config = replace(
                self.model_config, **{k: getattr(served, k) for k in TOKEN_FIELDS}
            )
            self._grammars = None
        self.__dict__.pop("model_identity", None)  # (the PD handshake's and L3's)
        if self.l3 is not None:
            # A namespace of this update's own: the identity samples a large shard, and an
            # update (a fine-tune step) may change only tensors the samples miss.
            identity = f"{self.model_identity}+update-{uuid.uuid4().hex}"
            self.l3.rename(storage_namespace(self.model_layout, identity, self.compute))
        if self.parallel.is_driver:
            log.info("weights updated from %s", _named(source))
        self._note_loaded(checked)


_BUSY = "busy"  # a rank that has requests: an update on every rank waits for idle ranks


_RELEASED_WEIGHTS = (
    "the weights are released (sleep mode): bring them back first (/resume_memory_occupation "
    "with tag weights, /wake_up; LLM.wake_up)"
)


def _named(source: str | GroupUpdate | TensorUpdate) -> str:
    """An update's source in a message: its checkpoint, the group it came over, or none."""
    if isinstance(source, GroupUpdate):
        return f"{len(source.names)} tensor(s) over {source.group_name!r}"
    if isinstance(source, TensorUpdate):
        return f"{len(source.tensors)} tensor(s)"
    return source


def updated(outcome: bool | str) -> bool:
    """`Engine.update_weights_here`'s outcome on rank 0: True/False, or its error raised."""
    if isinstance(outcome, str):
        raise DsakvError(outcome)
    return outcome
