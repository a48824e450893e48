"""`LLM`: offline batch generation, the way vLLM and SGLang users expect it."""

from __future__ import annotations

import atexit
import dataclasses
import os
import reprlib
import weakref
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeAlias

import numpy as np
from tqdm.auto import tqdm

from dsakv.distributed.weight_sync import GroupUpdate, TensorUpdate, WeightGroup
from dsakv.errors import DsakvError, is_int, is_list
from dsakv.metrics import LoopTimes, Metric, ServerMetrics
from dsakv.models.tiny import resolve_model_dir
from dsakv.procs import interrupts_deferred

from .beam_search import BeamSearch, BeamSearchParams, Step, advance_all, live_prompts
from .chat_format import has_chat_format, render_chat, template_message
from .config import EngineConfig, vllm_names_as_ours
from .detokenizer import TokenTexts, output_logprob_texts, prompt_logprob_texts
from .info import engine_info
from .launch import create_engine
from .lora import LoRARequest
from .request import Request
from .sampling import SamplingParams
from .score import label_probs, score_labels, score_params, score_prompts

# What `LLM.generate` takes as one prompt: text, token ids (ints or numpy's), or vLLM's
# prompt dicts.
Prompt: TypeAlias = str | Sequence[int] | np.ndarray | Mapping[str, Any]
Conversation: TypeAlias = Sequence[Mapping[str, Any]]  # chat messages, as OpenAI's


@dataclass(frozen=True)
class Logprob:
    """vLLM's: a token's logprob, its rank among the vocabulary (1 = likeliest) and its
    text (as the server's logprobs give it; None without a tokenizer)."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# vLLM's: per position, the scored token and its top-k alternatives by token id
SampleLogprobs: TypeAlias = list[dict[int, Logprob]]
PromptLogprobs: TypeAlias = list[dict[int, Logprob] | None]


@dataclass(frozen=True)
class CompletionOutput:
    """One choice of a prompt, as vLLM's `CompletionOutput`."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str
    # with `SamplingParams.logprobs`: per output token, the token's and its top-k's
    logprobs: SampleLogprobs | None
    cumulative_logprob: float | None  # the sum of the output tokens' logprobs
    # the stop string or `stop_token_ids` token that ended it (None: EOS, length, ...)
    stop_reason: str | int | None = None
    # with `SamplingParams.token_ids_logprob`: per output token, {id: logprob} of those ids
    token_ids_logprobs: list[dict[int, float]] | None = None
    # with `SamplingParams.return_routed_experts` (SGLang's): the experts each position's
    # token was routed to, prompt and output but the last token, from
    # `routed_experts_start_len` on: int32 `[n, num_hidden_layers, top_k]` (a dense layer's
    # 0); with `return_hidden_states`, those positions' last hidden states (final-normed)
    # from position 0: float32 `[n, hidden_size]`
    routed_experts: np.ndarray | None = None
    hidden_states: np.ndarray | None = None

    def finished(self) -> bool:
        """vLLM's (a method here, unlike `RequestOutput.finished`, as there)."""
        return bool(self.finish_reason)

    @classmethod
    def from_request(cls, index: int, req: Request, tokenizer: Any = None) -> CompletionOutput:
        asked = req.params.logprobs is not None
        return cls(
            index,
            req.output_text,
            list(req.output_ids),
            req.finish_reason or "",
            _output_logprobs(req, tokenizer) if asked else None,
            sum(req.logprobs) if asked else None,
            req.stop_reason,
            _by_id(req.params.token_ids_logprob, req.token_ids_logprobs) if asked else None,
            req.routed_experts,
            req.hidden_states,
        )


@dataclass(frozen=True)
class RequestOutput:
    """A prompt's `SamplingParams.n` choices (`outputs`, vLLM's shape); `text`, `token_ids`
    and `finish_reason` are the first choice's."""

    # vLLM's, a string: the first choice's engine request id (`Request.rid`), unique in the
    # process, as the engine's log lines name the request
    request_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    # counts summed over the choices; ttft_s the first's, latency_s the last to finish
    metrics: dict[str, float | int | None]
    # With `SamplingParams(prompt_logprobs=k)`, vLLM's: per prompt token (None for the
    # first), its teacher-forced logprob and its top-k alternatives'
    prompt_logprobs: PromptLogprobs | None = None
    error: str | None = None  # why it failed alone (finish_reason "error")
    prompt: str | None = None  # the prompt's text, where it was given as text (vLLM's)
    finished: bool = True  # vLLM's: no partial outputs here, generate returns finished ones
    # vLLM's: the prompt tokens the prefix cache held (the first choice's; the others
    # share its prompt pages)
    num_cached_tokens: int | None = None
    # With `SamplingParams(prompt_logprobs=k, token_ids_logprob=ids)`: per prompt token
    # (None where `prompt_logprobs` has none), {id: logprob} of those ids
    prompt_token_ids_logprobs: list[dict[int, float] | None] | None = None

    text = property(lambda self: self.outputs[0].text)
    token_ids = property(lambda self: self.outputs[0].token_ids)
    finish_reason = property(lambda self: self.outputs[0].finish_reason)

    @classmethod
    def from_requests(
        cls, reqs: Sequence[Request], prompt: str | None = None, tokenizer: Any = None
    ) -> RequestOutput:
        """The output of one prompt's choices (`Engine.add_requests`); `tokenizer` gives
        the logprobs' token texts."""
        first, ms = reqs[0], [r.metrics for r in reqs]
        latencies = [m.latency for m in ms]
        return cls(
            request_id=str(first.rid),
            prompt_token_ids=list(first.prompt_ids),
            outputs=[CompletionOutput.from_request(i, r, tokenizer) for i, r in enumerate(reqs)],
            metrics={
                "ttft_s": ms[0].ttft,
                "latency_s": None if None in latencies else max(latencies),
                "prefix_hit_tokens": sum(m.prefix_hit_tokens for m in ms),
                "retractions": sum(m.retractions for m in ms),
                "spec_draft_tokens": sum(m.draft_tokens for m in ms),
                "spec_accepted_tokens": sum(m.accepted_tokens for m in ms),
                "prompt_tokens": len(first.prompt_ids),
                "output_tokens": sum(len(r.output_ids) for r in reqs),
            },
            prompt_logprobs=_prompt_logprobs(first, tokenizer),
            error=next((r.error for r in reqs if r.error is not None), None),
            prompt=prompt,
            finished=all(r.finished for r in reqs),
            num_cached_tokens=ms[0].prefix_hit_tokens,
            prompt_token_ids_logprobs=(
                None
                if first.prompt_token_ids_logprobs is None
                else _by_id(first.params.token_ids_logprob, first.prompt_token_ids_logprobs)
            ),
        )


@dataclass(frozen=True)
class BeamSearchSequence:
    """vLLM's: one sequence a beam search found. As vLLM's offline beam search gives it,
    `tokens` and `text` hold the prompt's and the output's, and `logprobs` has each output
    token's position: its logprob and the 2 * beam_width likeliest tokens' of its step.
    `cum_logprob` sums the output's logprobs, of an EOS or stop token that ended it too
    (in `tokens` only with `include_stop_str_in_output`)."""

    tokens: list[int]
    logprobs: SampleLogprobs
    cum_logprob: float = 0.0
    text: str | None = None  # (None: the model has no tokenizer)
    finish_reason: str | None = None  # "stop" (EOS, a stop token or string) or "length"
    stop_reason: int | str | None = None  # the stop token or string (None: EOS, length)

    @classmethod
    def of(cls, req: Request, cum_logprob: float, tokenizer: Any = None) -> BeamSearchSequence:
        """A searched sequence (`BeamSearch.results`) in vLLM's shape."""
        text = None
        if tokenizer is not None:
            text = tokenizer.decode(req.prompt_ids) + req.output_text
        return cls(
            req.all_ids,
            _output_logprobs(req, tokenizer),
            cum_logprob,
            text,
            req.finish_reason,
            req.stop_reason,
        )


@dataclass(frozen=True)
class BeamSearchOutput:
    """vLLM's: a prompt's beam search sequences, best first (`beam_width` of them)."""

    sequences: list[BeamSearchSequence]


def _by_id(
    ids: Sequence[int] | None, positions: Sequence[Sequence[float] | None]
) -> list[dict[int, float] | None] | None:
    """`token_ids_logprob`'s per-position lists as {id: logprob} (None: not asked)."""
    if ids is None:
        return None
    return [None if x is None else dict(zip(ids, x)) for x in positions]


def _output_logprobs(req: Request, tokenizer: Any) -> SampleLogprobs:
    """`req`'s output logprobs in vLLM's shape, with the texts the server reports for them
    (`output_logprob_texts`)."""
    ids, tops = req.output_ids, req.top_logprobs
    texts, top_texts = [None] * len(ids), [[None] * len(top) for top in tops]
    if tokenizer is not None and ids and req.params.detokenize:
        kept = req.detokenizer
        if kept is None or kept.texts is None:
            kept = TokenTexts(tokenizer, req.params.skip_special_tokens, prompt=req.prompt_ids)
        texts, top_texts = output_logprob_texts(tokenizer, req, kept, 0, len(ids))
    return [
        _position(t, lp, rank, text, top, alt_texts)
        for t, lp, rank, text, top, alt_texts in zip(
            ids, req.logprobs, req.ranks, texts, tops, top_texts
        )
    ]


def _prompt_logprobs(req: Request, tokenizer: Any) -> PromptLogprobs | None:
    """`req`'s prompt logprobs in vLLM's shape (None for the first token), with texts as
    the server echoes them (`prompt_logprob_texts`)."""
    if req.prompt_logprobs is None:
        return None
    ids, tops = req.prompt_ids, req.prompt_top_logprobs
    texts, top_texts = [None] * len(ids), [[None] * len(top or ()) for top in tops]
    if tokenizer is not None and req.params.detokenize:
        texts, top_texts = prompt_logprob_texts(tokenizer, req)
    return [
        None if lp is None else _position(t, lp, rank, text, top, alt_texts)
        for t, lp, rank, text, top, alt_texts in zip(
            ids, req.prompt_logprobs, req.prompt_ranks, texts, tops, top_texts
        )
    ]


def _position(
    token: int,
    logprob: float,
    rank: int | None,
    text: str | None,
    top: Sequence[tuple[int, float]],
    top_texts: Sequence[str | None],
) -> dict[int, Logprob]:
    """One position's dict, as vLLM's: the scored token first, then its top-k alternatives
    ranked 1..k (the scored token among them keeps its own entry)."""
    out = {token: Logprob(logprob, rank, text)}
    for r, ((t, lp), s) in enumerate(zip(top, top_texts), 1):
        out.setdefault(t, Logprob(lp, r, s))
    return out


class LLM:
    """`LLM(model, **engine_args).generate(prompts, params)`: `model` a model directory or a
    tiny preset's name (as the `dsakv` commands take it), or an `EngineConfig`.
    `disable_log_stats=False` (vLLM's; off by default, as there) keeps the metrics
    `get_metrics` returns."""

    def __init__(
        self, model: str | EngineConfig, *, disable_log_stats: bool = True, **engine_args: Any
    ) -> None:
        if isinstance(model, EngineConfig):
            # (through from_kwargs: an unknown keyword is its one error, not replace's TypeError)
            given = {f.name: getattr(model, f.name) for f in dataclasses.fields(model)}
            args = vllm_names_as_ours(engine_args)
            config = EngineConfig.from_kwargs(**{**given, **args}) if args else model
        elif isinstance(model, (str, os.PathLike)):
            config = EngineConfig.from_kwargs(resolve_model_dir(str(model)), **engine_args)
        else:
            raise DsakvError(
                "model must be a model directory, a tiny preset's name or an EngineConfig, "
                f"got {reprlib.repr(model)}"
            )
        self.engine = create_engine(config)
        # (the server's registry; model_name the model's path, vLLM's default served name)
        self._stats = None
        if not disable_log_stats:
            self._stats = ServerMetrics(
                config.model,
                config.page_size,
                max_model_len=self.engine.max_model_len,
                max_loras=config.max_loras if config.enable_lora else None,
            )
        # Dropped or left open at exit, an LLM still stops its ranks (multiprocessing's exit
        # hook joins them, and they wait for rank 0 forever); registered after that hook,
        # this one runs first.
        self._close = weakref.finalize(self, self.engine.close)
        atexit.register(self._close)

    def close(self) -> None:
        """Stop the other ranks (with `tp > 1`); the object is unusable afterwards."""
        self._close()
        atexit.unregister(self._close)

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def get_tokenizer(self):
        """vLLM's: the model's tokenizer. Without one, an error saying so (vLLM raises too)
        rather than a None that fails later; `tokenizer` is None there, for a check."""
        if self.tokenizer is None:
            raise DsakvError(
                f"{self.engine.config.model} has no tokenizer; give prompts as token ids"
            )
        return self.tokenizer

    def update_weights(self, path: str | os.PathLike) -> None:
        """Load checkpoint `path` (the same architecture, stored alike) in place of the
        weights, as the server's /update_weights_from_disk (`Engine.update_weights`); the
        prefix cache is dropped. A checkpoint that does not fit is an error and the weights
        stay as they were."""
        self._update_weights(path)

    def _update_weights(self, source: str | os.PathLike | GroupUpdate | TensorUpdate) -> None:
        if not self.engine.update_weights(source):  # (generate returns with nothing running)
            raise DsakvError("weights are updated with no request running")

    def update_weights_from_tensor(
        self, named_tensors: Iterable[tuple[str, Any]], flush_cache: bool = True
    ) -> None:
        """SGLang's `Engine.update_weights_from_tensor`: copy `(checkpoint name, tensor)`
        pairs (some of the model's weights or all: a trainer in this process sends them in
        buckets, keeping the prefix cache with `flush_cache=False` until the last) into the
        weights in place; under `--tp` each rank copies its slices. A name the model does
        not have, or a shape it does not expect, is an error and changes nothing."""
        self._update_weights(TensorUpdate(tuple(named_tensors), flush_cache))

    def init_weights_update_group(
        self,
        master_address: str,
        master_port: int,
        rank_offset: int,
        world_size: int,
        group_name: str = "weight_update_group",
        backend: str = "nccl",
    ) -> None:
        """SGLang's: every rank joins a trainer's process group (rank `rank_offset` + its
        own; the trainer is rank 0), for `update_weights_from_distributed`."""
        spec = WeightGroup(
            master_address, master_port, rank_offset, world_size, group_name, backend
        )
        self.engine.join_weight_group(spec)

    def update_weights_from_distributed(
        self,
        names: Sequence[str],
        dtypes: Sequence[str],
        shapes: Sequence[Sequence[int]],
        group_name: str = "weight_update_group",
        flush_cache: bool = True,
    ) -> None:
        """SGLang's: receive the tensors the trainer broadcasts over `group_name` (in the
        order named) and copy them in, as `update_weights_from_tensor` does."""
        shaped = tuple(tuple(s) for s in shapes)
        self._update_weights(
            GroupUpdate(group_name, tuple(names), tuple(dtypes), shaped, flush_cache)
        )

    def destroy_weights_update_group(self, group_name: str = "weight_update_group") -> None:
        self.engine.leave_weight_group(group_name)

    def get_weights_by_name(self, name: str, truncate_size: int = 100) -> list:
        """SGLang's: the first `truncate_size` rows of checkpoint tensor `name` as served
        (fp32 nested lists, every rank's slices put together), to compare with what a
        trainer sent (`Engine.get_weights_by_name`). A name the model lacks is an error."""
        return self.engine.get_weights_by_name(name, truncate_size)

    def sleep(self, level: int = 1) -> None:
        """vLLM's sleep mode, for a trainer sharing the device: level 1 frees the KV cache
        and moves the weights to host memory, level 2 frees both (load new weights after
        `wake_up`: `update_weights*`); the prefix cache is dropped. `generate` is refused
        until `wake_up` (`Engine.sleep`)."""
        self.engine.sleep(level)

    def wake_up(self, tags: Sequence[str] | None = None) -> None:
        """vLLM's: bring back `tags` ("weights", "kv_cache"; None: everything slept)."""
        self.engine.wake_up(tags)

    def is_sleeping(self) -> bool:
        """vLLM's: whether any memory is still released."""
        return self.engine.is_sleeping()

    def release_memory_occupation(self, tags: Sequence[str] | None = None) -> None:
        """SGLang's `Engine.release_memory_occupation`: free "weights" (kept in host memory),
        "kv_cache" and "cuda_graph" (None: all) until `resume_memory_occupation`."""
        self.engine.release_memory_occupation(tags)

    def resume_memory_occupation(self, tags: Sequence[str] | None = None) -> None:
        """SGLang's: bring back what `tags` name (None: all), as it was."""
        self.engine.resume_memory_occupation(tags)

    def start_profile(
        self,
        output_dir: str | None = None,
        num_steps: int | None = None,
        activities: Sequence[str] | None = None,
        with_stack: bool | None = None,
        record_shapes: bool | None = None,
    ) -> None:
        """SGLang's: torch.profiler over the engine's steps (every rank's) until
        `stop_profile`, or `num_steps` steps (`Engine.start_profile`)."""
        self.engine.start_profile(output_dir, num_steps, activities, with_stack, record_shapes)

    def stop_profile(self) -> list[str]:
        """Stop the profile; the traces written (one per rank, `.trace.json.gz`)."""
        return self.engine.stop_profile()

    def start_expert_distribution_record(self) -> None:
        """SGLang's: count the experts each MoE layer routes tokens to from now on (an
        engine made with `expert_distribution_recorder_mode`)."""
        self.engine.start_expert_distribution_record()

    def stop_expert_distribution_record(self) -> None:
        self.engine.stop_expert_distribution_record()

    def dump_expert_distribution_record(self) -> list[str]:
        """Write the counts as SGLang's files (`Engine.dump_expert_distribution_record`);
        their paths."""
        return self.engine.dump_expert_distribution_record()

    def reset_prefix_cache(self) -> bool:
        """vLLM's: drop the prefix cache's pages (device and host tier), as the server's
        /reset_prefix_cache and /flush_cache do (`Engine.flush_cache`); False, dropping
        nothing, while requests run or wait (only ones added to `engine` directly can:
        `generate` returns with none)."""
        self._check_open()
        return self.engine.flush_cache()

    def flush_cache(self) -> bool:
        """SGLang's `Engine.flush_cache`: `reset_prefix_cache` (its success as a bool)."""
        return self.reset_prefix_cache()

    def score(
        self,
        query: str | Sequence[int],
        items: str | Sequence[str] | Sequence[Sequence[int]],
        label_token_ids: Sequence[int],
        apply_softmax: bool = False,
        item_first: bool = False,
    ) -> list[list[float]]:
        """SGLang's `Engine.score`: per item, the probability of each of `label_token_ids`
        being the next token after query + item (item + query with `item_first`; texts
        joined as strings, token ids as lists), or with `apply_softmax` their softmax over
        the labels; what the server's /v1/score answers (`dsakv.engine.score`)."""
        self._check_open()
        labels = score_labels(label_token_ids, self.engine.model_config.vocab_size)
        prompts = score_prompts(query, items, item_first)
        groups = self._run(prompts, [score_params(labels)] * len(prompts), use_tqdm=False)
        scores = []
        for i, (req,) in enumerate(groups):
            if not req.token_ids_logprobs:  # (a prompt the pool cannot hold ends at once)
                raise DsakvError(f"item {i} ended ({req.finish_reason}) before it was scored")
            scores.append(label_probs(req.token_ids_logprobs[0], apply_softmax))
        return scores

    def get_server_info(self) -> dict[str, Any]:
        """SGLang's `Engine.get_server_info`: the engine's settings under SGLang's names,
        its pool's size and `internal_states`, as the server's /server_info gives them
        (`dsakv.engine.info`) less its PD role; served under the model's path (SGLang's
        default `served_model_name`)."""
        self._check_open()
        return engine_info(self.engine, self.engine.counters(), self.engine.config.model)

    def get_metrics(self) -> list[Metric]:
        """vLLM's: the `vllm:` metrics a server's /metrics has (`dsakv.metrics`), as
        vLLM's `Counter`, `Gauge` and `Histogram` (from `dsakv.engine`): the engine's counters
        now, and the latencies of the requests `generate`, `chat`, `score` and `beam_search`
        ran; with `enable_lora`, vLLM's lora_requests_info gauge (the adapters with requests
        running and waiting). Kept with `LLM(..., disable_log_stats=False)`, as vLLM's."""
        self._check_open()
        if self._stats is None:
            raise DsakvError("get_metrics needs LLM(..., disable_log_stats=False), as vLLM's")
        return self._stats.vllm_metrics(self.engine.counters(), self.engine.lora_requests())

    def _check_open(self) -> None:
        if not self._close.alive:
            raise DsakvError("this LLM was closed; make a new one")

    def get_default_sampling_params(self) -> SamplingParams:
        """What `generate` uses without params (vLLM's): SamplingParams' defaults, with the
        sampling fields the model's generation_config.json sets."""
        return SamplingParams(**self.engine.model_config.sampling_defaults)

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        *,
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        priority: Sequence[int] | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Complete every prompt: text, token ids (ints, or a 1-D numpy integer array), or
        vLLM's `{"prompt": text}` / `{"prompt_token_ids": ids}` (with vLLM's `"cache_salt"`:
        it shares prefix-cache pages only with prompts of the same salt); one `params` for
        all, or one per prompt (by keyword `params` or vLLM's `sampling_params`). Outputs come
        back in input order; `use_tqdm` (vLLM's default, on) shows a progress bar on stderr.
        `priority`: vLLM's, one per prompt, under priority scheduling (`scheduling_policy`).
        `lora_request`: vLLM's, one for all or one per prompt (None: the base model), each
        adapter loaded by its name on first use (the engine needs `enable_lora`)."""
        self._check_open()
        params = _params_or_vllms(params, sampling_params)
        listed = _listed_prompts(prompts)
        salts = [_prompt_salt(p) for p in listed]
        prompts = [_one_prompt(p) for p in listed]
        if params is None:
            params = self.get_default_sampling_params()
        plist = _as_params_list(params, len(prompts))
        plist = [
            sp if s is None else dataclasses.replace(sp, cache_salt=s)
            for sp, s in zip(plist, salts)
        ]
        if priority is not None:
            if not is_list(priority) or len(priority) != len(prompts):
                raise DsakvError(
                    f"priority must be a list of one integer per prompt ({len(prompts)}), got "
                    f"{reprlib.repr(priority)}",
                    "priority",
                )
            plist = [dataclasses.replace(sp, priority=p) for sp, p in zip(plist, priority)]
        if lora_request is not None:
            plist = self._on_loras(plist, lora_request)
        groups = self._run(prompts, plist, use_tqdm)
        tokenizer = self.tokenizer
        return [
            RequestOutput.from_requests(g, p if isinstance(p, str) else None, tokenizer)
            for g, p in zip(groups, prompts)
        ]

    def _on_loras(
        self,
        plist: list[SamplingParams],
        lora_request: LoRARequest | Sequence[LoRARequest | None],
    ) -> list[SamplingParams]:
        """`plist` on the adapters `lora_request` names (one for all, or one per prompt),
        each loaded first where it is not yet (by name; a name loaded from another path
        is refused)."""
        if isinstance(lora_request, LoRARequest):
            lora_request = [lora_request] * len(plist)
        if not is_list(lora_request) or len(lora_request) != len(plist):
            raise DsakvError(
                f"lora_request must be a LoRARequest or a list of one per prompt ({len(plist)}, "
                f"None for the base model), got {reprlib.repr(lora_request)}",
                "lora_request",
            )
        for lr in lora_request:
            if lr is not None and not isinstance(lr, LoRARequest):
                raise DsakvError(f"not a LoRARequest: {reprlib.repr(lr)}", "lora_request")
            if lr is None:
                continue
            loaded = self.engine.loras().get(lr.lora_name)
            if loaded is None:
                self.engine.load_lora(lr.lora_name, lr.lora_path)
            elif loaded != lr.lora_path:
                raise DsakvError(
                    f"LoRA adapter {lr.lora_name!r} is loaded from {loaded}, not {lr.lora_path}",
                    "lora_request",
                )
        return [
            sp if lr is None else dataclasses.replace(sp, lora_name=lr.lora_name)
            for sp, lr in zip(plist, lora_request)
        ]

    def _run(
        self,
        prompts: Sequence[str | list[int]],
        plist: Sequence[SamplingParams],
        use_tqdm: bool = True,
    ) -> list[list[Request]]:
        """Each prompt's requests (its `plist` entry's `n` choices), run to their end: the
        engine loop of `generate`, `score` and each `beam_search` step."""
        groups: list[list[Request]] = []
        reqs: list[Request] = []
        times = None if self._stats is None else LoopTimes(self._stats)
        try:
            for p, sp in zip(prompts, plist):
                groups.append(self.engine.add_requests(p, sp))
                reqs += groups[-1]
            # vLLM's default: a bar on stderr (closed on an error too, so its message starts a line)
            with (
                tqdm(total=len(reqs), desc="generate", disable=not use_tqdm) as bar,
                interrupts_deferred() as check,
            ):
                while self.engine.has_unfinished():
                    stepped = self.engine.step()
                    if times is not None:
                        times.stepped(stepped)
                    bar.update(sum(1 for r in stepped if r.finished))
                    check()
        except BaseException:  # a bad prompt further on, Ctrl-C: none of this call's stay
            for r in reqs:
                self.engine.abort(r.rid)
            raise
        return groups

    def beam_search(
        self,
        prompts: Prompt | Sequence[Prompt],
        params: BeamSearchParams,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
        use_tqdm: bool = False,
        concurrency_limit: int | None = None,
    ) -> list[BeamSearchOutput]:
        """vLLM's `LLM.beam_search`: each prompt's best `params.beam_width` sequences, best
        first (`dsakv.engine.beam_search`: each step runs one request per live beam,
        which the prefix cache serves all but its last tokens). Prompts as `generate` takes
        them; `lora_request`: `generate`'s (every step's requests run on it);
        `concurrency_limit`: search that many prompts at a time (vLLM's; None: all);
        `use_tqdm`: a bar over each batch's steps."""
        self._check_open()
        if not isinstance(params, BeamSearchParams):
            raise DsakvError(
                f"params must be a BeamSearchParams, got {reprlib.repr(params)}", "params"
            )
        limit = concurrency_limit
        if limit is not None and not (is_int(limit) and limit >= 1):
            raise DsakvError(
                f"concurrency_limit must be None or an integer >= 1, got {limit!r}",
                "concurrency_limit",
            )
        listed = _listed_prompts(prompts)
        salts = [_prompt_salt(p) for p in listed]
        ids = [self.engine.prompt_ids(_one_prompt(p)) for p in listed]
        searches = [BeamSearch(self.engine, x, params) for x in ids]
        steps = [params.step_params(cache_salt=s) for s in salts]
        if lora_request is not None:
            steps = self._on_loras(steps, lora_request)
        limit = limit or max(len(searches), 1)
        for start in range(0, len(searches), limit):
            batch = list(zip(searches[start : start + limit], steps[start : start + limit]))
            most = max(s.steps_left for s, _ in batch)
            with tqdm(total=most, desc="beam search", unit="token", disable=not use_tqdm) as bar:
                group = [s for s, _ in batch]
                while prompts := live_prompts(group):
                    each = [sp for s, sp in batch if not s.done for _ in s.live]
                    advance_all(group, (Step.of(g[0]) for g in self._run(prompts, each, False)))
                    bar.update()
        top_n, tokenizer = 2 * params.beam_width, self.tokenizer
        return [
            BeamSearchOutput([BeamSearchSequence.of(r, c, tokenizer) for r, c in s.results(top_n)])
            for s in searches
        ]

    def chat(
        self,
        messages: Conversation | Sequence[Conversation],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        *,
        chat_template: str | None = None,
        chat_template_kwargs: Mapping[str, Any] | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: list[dict[str, Any]] | None = None,
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """vLLM's `LLM.chat`: one conversation (a list of `{"role", "content"}` messages)
        or a list of them, each rendered by the model's chat template (DeepSeek-V3.2, which
        ships none, by its encoding: `render_chat`) and completed as
        `generate` completes text (`chat_template`: a Jinja template instead of the
        tokenizer's; `sampling_params`: vLLM's name for `params`). The output is the raw
        text: tool calls and reasoning are parsed by `dsakv serve`'s chat endpoint, not
        here. `lora_request`: `generate`'s."""
        params = _params_or_vllms(params, sampling_params)
        # vLLM's: chat_template_kwargs may set the named arguments too, and win
        kwargs = {
            "chat_template": chat_template,
            "add_generation_prompt": add_generation_prompt,
            "continue_final_message": continue_final_message,
            "tools": tools,
            **(chat_template_kwargs or {}),
        }
        if kwargs["continue_final_message"] and kwargs["add_generation_prompt"]:
            raise DsakvError("continue_final_message needs add_generation_prompt=False")
        if isinstance(messages, Sequence) and messages and isinstance(messages[0], Mapping):
            messages = [messages]  # one conversation
        if not is_list(messages) or not all(is_list(c) and c for c in messages):
            raise DsakvError(
                "messages must be a conversation (a non-empty list of message dicts) or a "
                f"list of them, got {reprlib.repr(messages)}",
                "messages",
            )
        tokenizer, model_type = self.tokenizer, self.engine.model_config.model_type
        if not has_chat_format(tokenizer, model_type, kwargs["chat_template"]):
            raise DsakvError("this model's tokenizer has no chat template", "messages")
        prompts = []
        for conversation in messages:
            rendered = [template_message(i, m) for i, m in enumerate(conversation)]
            try:
                prompts.append(render_chat(tokenizer, rendered, model_type, **kwargs))
            except DsakvError:
                raise
            except Exception as e:  # the template's raise_exception: bad roles or order
                raise DsakvError(f"chat template failed: {e}", "messages") from None
        # Each rendered template holds its special tokens (a BOS): none added, as vLLM's chat
        ids = [self.engine.encode(p, special=False) for p in prompts]
        outs = self.generate(ids, params, use_tqdm, lora_request=lora_request)
        return [dataclasses.replace(o, prompt=p) for o, p in zip(outs, prompts)]


def _params_or_vllms(params: Any, sampling_params: Any) -> Any:
    """`params`, or vLLM's keyword for it, `sampling_params`; not both."""
    if sampling_params is None:
        return params
    if params is not None:
        raise DsakvError("give params or sampling_params (vLLM's name for it), not both", "params")
    return sampling_params


PROMPT_KEYS = ("prompt", "prompt_token_ids")  # vLLM's TextPrompt and TokensPrompt
PROMPT_KINDS = "a string, a list of int token ids, or a dict with 'prompt' or 'prompt_token_ids'"


def _listed_prompts(prompts: object) -> list:
    """One prompt or a list of them (any iterable, read once), as vLLM takes them (a str
    or dict is one prompt; so is a list of ints, dsakv's own shorthand). Anything else is
    refused here: bytes and bools would otherwise pass for token ids, and a dict for a
    list of its keys."""
    if isinstance(prompts, (str, Mapping, np.ndarray)) or _all_ints(prompts):
        return [prompts]
    if isinstance(prompts, (bytes, bytearray)) or not isinstance(prompts, Iterable):
        raise DsakvError(
            f"prompts must be a prompt ({PROMPT_KINDS}) or a list of them, "
            f"got {reprlib.repr(prompts)}",
            "prompts",
        )
    return list(prompts)


def _prompt_salt(prompt: object) -> str | None:
    """A prompt's `cache_salt` (vLLM's prompt dict key; None: its params' own), or a
    `DsakvError` for one that is not a non-empty string."""
    salt = prompt.get("cache_salt") if isinstance(prompt, Mapping) else None
    if salt is not None and not (isinstance(salt, str) and salt):
        raise DsakvError(
            f"'cache_salt' must be a non-empty string, got {reprlib.repr(salt)}", "prompts"
        )
    return salt


def _all_ints(x: object) -> bool:
    """A non-empty sequence of ints, Python's or numpy's (bools too, so that they are
    refused as token ids rather than taken one by one as prompts)."""
    return is_list(x) and len(x) > 0 and all(isinstance(t, (int, np.integer, np.bool_)) for t in x)


def _one_prompt(p: object) -> str | list[int]:
    """One prompt as text or token ids; a prompt dict is unwrapped first."""
    if isinstance(p, Mapping):
        keys = [k for k in PROMPT_KEYS if k in p]
        if len(keys) != 1 or len(p) != 1 + ("cache_salt" in p):
            raise DsakvError(
                "a prompt dict has one key, 'prompt' (text) or 'prompt_token_ids', and "
                f"optionally 'cache_salt', got keys {sorted(map(str, p))}",
                "prompts",
            )
        p = p[keys[0]]
        if keys[0] == "prompt" and not isinstance(p, str):
            raise DsakvError(f"'prompt' must be a string, got {reprlib.repr(p)}", "prompts")
        if keys[0] == "prompt_token_ids" and not (is_list(p) or isinstance(p, np.ndarray)):
            raise DsakvError(
                f"'prompt_token_ids' must be a list of ints, got {reprlib.repr(p)}", "prompts"
            )
    if isinstance(p, str):
        return p
    if isinstance(p, np.ndarray):
        if p.ndim != 1 or p.dtype.kind not in "iu":
            raise DsakvError(
                f"a token-id array must be 1-D of integers, got {p.ndim}-D of {p.dtype}",
                "prompts",
            )
        return p.tolist()
    if not is_list(p):
        raise DsakvError(f"a prompt is {PROMPT_KINDS}, got {reprlib.repr(p)}", "prompts")
    bad = [t for t in p if not (is_int(t) or isinstance(t, np.integer))]
    if bad:
        raise DsakvError(f"token ids must be ints, got {reprlib.repr(bad[0])}", "prompts")
    return [int(t) for t in p]  # numpy's ints as Python's


def _as_params_list(params: object, n: int) -> list[SamplingParams]:
    """`params` for each of `n` prompts: None (the defaults), one `SamplingParams` for
    all, or a list of one per prompt (vLLM's rules)."""
    if params is None:
        params = SamplingParams()
    if isinstance(params, SamplingParams):
        return [params] * n
    if not is_list(params) or not all(isinstance(p, SamplingParams) for p in params):
        hint = " (for a dict of settings: SamplingParams(**settings))"
        raise DsakvError(
            "params must be a SamplingParams or a list of them, one per prompt, got "
            f"{reprlib.repr(params)}{hint if isinstance(params, Mapping) else ''}",
            "params",
        )
    if len(params) != n:
        raise DsakvError(
            f"{n} prompts but {len(params)} sampling params: give one for all or one per prompt",
            "params",
        )
    return list(params)
