"""LLMEngine: add / abort / step, and the processing of each step's output.

The engine owns the scheduler (what runs), the runner (how it runs) and the detokenizers; it
turns each step's sampled tokens into text deltas, applies stop conditions and frees pages.
A request is checked once, when it is made (`new_request`: the sampling settings were checked
when they were built; here the prompt: its ids, its length, whether it fits the KV pool), and
then carries its own state: its sequences (with their seeds), detokenizers and text so far.
Its RequestOutputs are deltas (what each step added); `jaxserve.llm` gathers them into the
offline API's final outputs, `jaxserve.engine_thread` streams them to the server.

A step that raises (a device error, an out-of-memory, a bug) raises StepError naming the requests
it ran, and of the step still running with the overlapped loop (`LLMEngine.step`); the caller
aborts them (which frees their pages) and the engine serves the rest. For tests, the environment
variable JAXSERVE_FAULT_STEPS ("3,4") makes those model steps (counted from 1, warm-up excluded)
raise InjectedFault when launched, after scheduling, as a device error would.
"""
from __future__ import annotations

import itertools
import os
import time

import jax.numpy as jnp
import numpy as np

from jaxserve import lora, parallel, pooling
from jaxserve import quantization as quant
from jaxserve.block_manager import BlockManager, sequence_pages
from jaxserve.checkpoint import load_for_mesh, resolve_dtype, saved_lm_head, saved_quantization
from jaxserve.config import EngineConfig
from jaxserve.outputs import CompletionOutput, Request, RequestOutput, join
from jaxserve.runner import ModelRunner, SampleResult
from jaxserve.sampling import reads_outputs, samples_ahead
from jaxserve.sampling_params import InvalidRequest, PoolingParams, SamplingParams
from jaxserve.scheduler import Scheduler, SchedulerOutput
from jaxserve.sequence import Sequence
from jaxserve.sleep_mode import require_awake
from jaxserve.spec_decode import ngram
from jaxserve.spec_decode.draft import DraftProposer, draft_model
from jaxserve.spec_decode.throttle import Throttle
from jaxserve.step_ops import Launched
from jaxserve.structured.grammar import Grammars
from jaxserve.token_limits import check_token_ids, sequence_limits
from jaxserve.tokenizer import IncrementalDetokenizer, load_tokenizer

TINY_MODEL_DIR = os.path.join(os.path.dirname(__file__), "assets", "tiny")
FAULT_STEPS_ENV = "JAXSERVE_FAULT_STEPS"


class InjectedFault(RuntimeError):
    """Raised by the steps listed in JAXSERVE_FAULT_STEPS."""


class StepError(RuntimeError):
    """A step raised; the requests it ran (`request_ids`) are lost, the others untouched."""

    def __init__(self, request_ids: list[str], cause: Exception):
        super().__init__(f"{type(cause).__name__}: {cause}")
        self.request_ids = request_ids


class LLMEngine:
    def __init__(self, engine_cfg: EngineConfig | None = None, *, params=None, mesh=None):
        self.model_dir = model_dir = (engine_cfg or EngineConfig()).model or TINY_MODEL_DIR
        # runner auto resolved; an embedding engine's pooling (None: text generation)
        self.ecfg, self.model_cfg, self.pooler = pooling.configure(engine_cfg or EngineConfig(), model_dir)
        self.tokenizer = load_tokenizer(model_dir)
        self.dtype = resolve_dtype(self.ecfg.dtype)
        mesh = mesh if mesh is not None else parallel.make_mesh(self.ecfg.mesh)
        if params is None:
            params = load_for_mesh(model_dir, self.model_cfg, self.dtype, self.ecfg.quantization, mesh,
                                   self.ecfg.quantize_lm_head)
        else:   # given full-precision params (tests, benchmarks) are quantized as loaded ones are
            params = quant.quantize_params(params, self.ecfg.quantization or saved_quantization(model_dir),
                                           lm_head=self.ecfg.quantize_lm_head or saved_lm_head(model_dir))
        self.loras = lora.Adapters(self.model_cfg, self.ecfg, mesh, self.dtype) if self.ecfg.serves_lora else None
        draft = draft_model(self.ecfg, model_dir, self.model_cfg, TINY_MODEL_DIR)
        self.runner = ModelRunner(self.model_cfg, params, self.ecfg, mesh=mesh, dtype=self.dtype, lora=self.loras,
                                  draft=draft)
        self.max_model_len = self.runner.max_model_len
        spec = self.ecfg.speculative
        self.draft = draft and DraftProposer(draft, self.ecfg, self.runner.num_pages, self.max_model_len, mesh,
                                             self.dtype)   # the draft-model proposer
        self.throttle = spec and Throttle(spec, self.model_cfg, self.draft and self.draft.runner.cfg,
                                          jnp.dtype(self.dtype).itemsize)   # which steps speculate
        self.block_manager = BlockManager(self.runner.num_pages, self.ecfg.page_size, self.ecfg.enable_prefix_caching,
                                          self.ecfg.poison_freed_pages, self.runner.kv_groups)
        self.scheduler = Scheduler(self.ecfg, self.block_manager, self.max_model_len)
        self.eos_token_ids = set(self.tokenizer.eos_token_ids) | set(self.model_cfg.eos_token_ids)
        self.grammars = Grammars(self.tokenizer, self.model_cfg.vocab_size, self.eos_token_ids)
        self._requests: dict[str, Request] = {}
        self._rng = np.random.default_rng(self.ecfg.seed)
        self._ids = itertools.count()
        self.stats = dict.fromkeys(("prompt_tokens", "generation_tokens", "steps", "failed_steps", "requests_finished",
                                    "spec_verify_rows", "spec_proposed_tokens", "spec_accepted_tokens",
                                    "spec_draft_steps", "spec_off_steps", "multi_step_decodes"), 0)
        self._fault_steps = {int(n) for n in os.environ.get(FAULT_STEPS_ENV, "").split(",") if n.strip()}
        self.last_schedule = None   # the SchedulerOutput of the latest step (roofline accounting)
        # Plan step N+1 while step N runs (see `step`); off: each step is collected before the next is planned.
        self.overlap = True
        # On a GPU launching a conditional (the sampler has 3) holds the host until the device gets there.
        self._defer_all_samplers = parallel.platform(mesh) in ("gpu", "cuda")
        self._inflight: tuple[SchedulerOutput, Launched] | None = None   # launched, not yet collected
        self._launches = 0
        self.sleeping: dict[str, list] = {}   # what jaxserve/sleep_mode.py put away, by tag; empty: awake

    def warmup(self, background: bool = False) -> int:
        """Build the step executables (the target's smaller shapes on a thread when `background`;
        the draft's all at once)."""
        return self.runner.warmup(background) + (self.draft.warmup() if self.draft is not None else 0)

    # ---- requests ----
    def new_request(self, prompt_token_ids: list[int], params: SamplingParams | PoolingParams,
                    request_id: str | None = None, arrival_time: float | None = None) -> Request:
        """The one check of a request, at the edge (LLM.generate, EngineThread.submit): raises
        InvalidRequest on a prompt the engine cannot serve. Safe to call from any thread.
        The prompt is first cut to params.truncate_prompt_tokens (SamplingParams.resolve).
        PoolingParams make an embedding request (an engine with runner pooling): its prompt runs
        as a prefill whose one sampled token is dropped (jaxserve/pooling.py). EngineAsleep while
        the engine sleeps (jaxserve/sleep_mode.py)."""
        require_awake(self)
        params, pooled = pooling.served(self.pooler, params, self.model_cfg.hidden_size)
        prompt_token_ids, params = params.resolve(prompt_token_ids, self.max_model_len)
        if not prompt_token_ids:
            raise InvalidRequest("prompt is empty", param="prompt")
        check_token_ids(prompt_token_ids, params, self.model_cfg.vocab_size)
        adapter = lora.resolve(self.loras, params.lora_name)
        total = len(prompt_token_ids) + (params.max_tokens if pooled is None else 0)
        if total > self.max_model_len:
            tokens = "" if pooled else f" and max_tokens is {params.max_tokens} ({total} in total)"
            raise InvalidRequest(f"this model's maximum context length is {self.max_model_len} tokens; the prompt "
                                 f"has {len(prompt_token_ids)} tokens{tokens}", param="prompt")
        # The last sampled token is never written to the cache (max_tokens 0 samples one, dropped).
        bm, written = self.block_manager, len(prompt_token_ids) + max(params.max_tokens, 1) - 1
        pages = sequence_pages(bm.windows, bm.page_size, written, self.ecfg.max_num_batched_tokens)
        if pages > bm.num_pages - bm.reserved:
            raise InvalidRequest(f"{len(prompt_token_ids)} prompt tokens + max_tokens={params.max_tokens} need "
                                 f"{pages} KV pages of {self.ecfg.page_size} tokens, but the pool has "
                                 f"{bm.num_pages - bm.reserved}; shorten the prompt or lower max_tokens",
                                 param="prompt")
        request_id = request_id or f"req-{next(self._ids)}"
        arrival = arrival_time if arrival_time is not None else time.monotonic()
        ends = tuple(dict.fromkeys(params.stop_token_ids + ([] if params.ignore_eos else sorted(self.eos_token_ids))))
        grammars = self.grammars.matchers(params.structured_output, params.n)
        limits = sequence_limits(params, self.tokenizer, self.model_cfg.vocab_size)
        seqs = [Sequence(request_id=request_id, prompt_token_ids=list(prompt_token_ids), sampling=params,
                         arrival_time=arrival, index=i, end_token_ids=ends, grammar=grammars[i], lora=adapter,
                         pooling=pooled, **limits)
                for i in range(params.n)]
        return Request(request_id, list(prompt_token_ids), params, arrival, seqs)

    def add(self, req: Request) -> str:
        """Schedule a request made by `new_request` (on the thread that steps the engine)."""
        if req.request_id in self._requests:
            raise InvalidRequest(f"duplicate request id {req.request_id!r}")
        for seq in req.seqs:
            # Choices of one seeded request differ from each other but repeat run to run.
            seq.seed = (req.params.seed + seq.index if req.params.seed is not None
                        else int(self._rng.integers(2**31)))
            self.scheduler.add(seq)
        req.detoks = [IncrementalDetokenizer(self.tokenizer, req.prompt_token_ids, req.params.skip_special_tokens)
                      for _ in req.seqs]
        req.texts, req.emitted = [""] * len(req.seqs), [0] * len(req.seqs)
        self._requests[req.request_id] = req
        self.stats["prompt_tokens"] += len(req.prompt_token_ids)
        return req.request_id

    def add_request(self, prompt_token_ids: list[int], params: SamplingParams,
                    request_id: str | None = None, arrival_time: float | None = None) -> str:
        """new_request then add, for callers that step the engine themselves."""
        return self.add(self.new_request(prompt_token_ids, params, request_id, arrival_time))

    def abort(self, request_id: str) -> RequestOutput | None:
        req = self._requests.get(request_id)
        if req is None:
            return None
        del self._requests[req.request_id]
        self.scheduler.abort(request_id)
        return self._output(req, [CompletionOutput(s.index, "", [], None, "abort") for s in req.seqs], finished=True)

    def has_unfinished(self) -> bool:
        return bool(self._requests)

    @property
    def num_requests(self) -> int:
        return len(self._requests)

    # ---- one step ----
    def step(self) -> list[RequestOutput]:
        """Plan and launch one step, and return the outputs of the step launched before it.

        Overlapped (`overlap`): the previous step's model still runs on the device while this call
        plans the next one, whose decode rows read their input tokens (PENDING on the host) from
        the previous step's sampled tokens on the device. Then the previous step's sampler is
        launched if it waited (all do on a GPU, `_defer_all_samplers`; elsewhere those whose arrays
        read outputs: grammar masks, penalty history), then the new step's model; the previous
        step's results are collected, detokenized, checked for stops and returned while the device
        runs the new step. A stop found there is found one step late: the sequence's row in the new
        step is discarded when that step is collected. Speculative decoding and sequence-parallel
        prefill collect the previous step first (the synchronous order): a step that speculates
        (spec_decode/throttle.py decides which), or follows one that did. Raises StepError naming
        the requests of the steps involved when one fails (the caller aborts them)."""
        previous, self._inflight = self._inflight, None
        outputs = []
        if self.throttle is not None:   # the time since the last step's planning prices a step
            self.throttle.begins()
        if previous is not None and not self._can_overlap(previous[0]):
            outputs, previous = self._guarded([previous[0]], lambda: self._collect(*self._sampled(previous))), None
        speculate = self._speculates()
        if previous is not None and speculate:
            outputs, previous = self._guarded([previous[0]], lambda: self._collect(*self._sampled(previous))), None
        planning, catching_up = time.perf_counter(), 0.0
        self._propose(speculate)
        out = self.last_schedule = self.scheduler.schedule(self._decode_steps())
        running = [previous[0]] if previous is not None else []
        if self.draft is not None:   # (a step with verify rows is never overlapped: nothing is running)
            steps, catching_up = self._guarded([out], lambda: self.draft.propose(out))
            self.stats["spec_draft_steps"] += steps
        previous = previous and self._guarded(running, lambda: self._sampled(previous))
        if out.scheduled or out.page_copies:
            self._inflight = out, self._guarded(running + [out], lambda: self._launch(out))
        if self.throttle is not None:
            self.throttle.planned(time.perf_counter() - planning, catching_up,
                                  sum(s.num_sampled > 1 for s in out.scheduled))
        if previous is not None:
            outputs += self._guarded(running + [out], lambda: self._collect(*previous))
        if self.throttle is not None and not self.has_unfinished():
            self.throttle.idle()   # until the next request: no step's time
        return outputs

    def _sampled(self, step: tuple[SchedulerOutput, Launched]) -> tuple[SchedulerOutput, Launched]:
        out, launched = step   # its sampler launched, if it was waiting (see `step`)
        return out, launched if launched.sampler_arrays is None else self.runner.sample(launched)

    def _guarded(self, steps: list[SchedulerOutput], run):
        try:
            return run()
        except Exception as e:
            self._inflight = None
            self.stats["failed_steps"] += 1
            raise StepError(sorted({s.seq.request_id for out in steps for s in out.scheduled}), e) from e

    def _can_overlap(self, previous: SchedulerOutput) -> bool:
        """Whether the next step, without verify rows, may be planned before the `previous`
        one's sampled tokens are on the host (not if it had verify rows: their accepted runs)."""
        return (self.overlap and not self.runner.prefills_sequence_parallel
                and not any(s.num_sampled > 1 for s in previous.scheduled))

    def _launch(self, out: SchedulerOutput) -> Launched:
        self._launches += 1
        if self._launches in self._fault_steps:
            raise InjectedFault(f"step {self._launches} fails ({FAULT_STEPS_ENV})")
        now = time.monotonic()
        for s in out.scheduled:
            req = self._requests[s.seq.request_id]
            req.first_scheduled_time = req.first_scheduled_time or now
        if self.ecfg.poison_freed_pages:
            out = self.runner.poison_pages(out, self.block_manager.drain_stale_pages())
        if self.loras is not None:   # the running sequences' adapters in slots (the scheduler bounds how many)
            self.loras.assign(self.scheduler.running)
        sample_later = self._can_overlap(out) and out.decode_steps == 1 and any(   # see `step`
            s.num_sampled and (self._defer_all_samplers or reads_outputs(s.seq)) for s in out.scheduled)
        launched = self.runner.launch(out, {s.seq.seq_id: s.seq.seed for s in out.scheduled}, sample_later)
        self.stats["multi_step_decodes"] += out.decode_steps > 1
        self.scheduler.launched(out)
        return launched

    def _collect(self, out: SchedulerOutput, launched: Launched) -> list[RequestOutput]:
        """The launched step's results: accepted tokens, detokenized deltas, stops, finished
        requests. Rows of sequences that finished (a stop found late, an abort) are dropped."""
        results = self.runner.collect(launched)
        # (sequence, its accepted run: a verify row's is cut at the first rejection, its outputs before this step)
        rows = [(s.seq, results[s.seq.seq_id] if s.num_sampled == 1 or s.num_steps > 1 else
                 self._accept(s.seq.proposed_token_ids, results[s.seq.seq_id]), s.seq.num_known_outputs)
                for s in out.scheduled if s.num_sampled and not s.seq.is_finished]
        tokens = {seq.seq_id: [r.token for r in run] for seq, run, _ in rows}
        self.scheduler.resolve(out, tokens)
        self.stats["steps"] += 1
        now = time.monotonic()
        texts = self._detokenize([seq for seq, _, _ in rows], tokens)
        deltas: dict[str, list[CompletionOutput]] = {}
        for seq, run, first in rows:
            req = self._requests[seq.request_id]
            if req.params.max_tokens == 0 or seq.pooling is not None:   # the prompt is scored or pooled:
                self.scheduler.finish(seq, "length")                         # its sampled token is dropped
                deltas.setdefault(seq.request_id, []).append(CompletionOutput(seq.index, "", [], None, "length"))
                continue
            if req.first_token_time is None:
                req.first_token_time = now
            delta = None
            for i, res in enumerate(run):   # one, or a run (verify, multi-step): cut where it ends
                req.num_generated += 1
                self.stats["generation_tokens"] += 1
                d = self._advance(req, seq, res, first + i + 1, texts[seq.seq_id][i])
                delta = d if delta is None else join(delta, d)
                if seq.is_finished:   # drops what followed, a later step's PENDING token too
                    del seq.output_token_ids[first + i + 1:]
                    break
            deltas.setdefault(seq.request_id, []).append(delta)
        outputs = []
        for request_id, choice_outputs in deltas.items():
            req = self._requests[request_id]
            finished = all(seq.is_finished for seq in req.seqs)
            outputs.append(self._output(req, choice_outputs, finished))
            if req.params.prompt_logprobs is not None and not req.prompt_logprobs_sent:
                # choice 0 scored the whole prompt before any choice sampled
                outputs[-1].prompt_logprobs, req.prompt_logprobs_sent = req.seqs[0].prompt_logprobs, True
            if finished and req.seqs[0].pooling is not None:
                outputs[-1].pooled = req.seqs[0].pooling.result(len(req.prompt_token_ids))
            if finished:
                del self._requests[req.request_id]
                self.stats["requests_finished"] += 1
        return outputs

    def _decode_steps(self) -> int:
        """The next step's decode_steps (scheduler.py): 1 while a prompt waits for a seat (it would
        wait the k steps), or a running sequence has not sampled yet or cannot sample ahead."""
        ahead = self.ecfg.decode_steps > 1 and not self.scheduler.prefills_next() and all(
            s.output_token_ids and samples_ahead(s) for s in self.scheduler.running)
        return self.ecfg.decode_steps if ahead else 1

    def _speculates(self) -> bool:
        """Whether the next step speculates (spec_decode/throttle.py), over the sequences that would verify."""
        if self.throttle is None:
            return False
        contexts = [s.num_computed_tokens for s in self.scheduler.running if s.num_tokens - s.num_computed_tokens == 1]
        speculate = self.throttle.speculates(contexts, self.scheduler.prefills_next())
        self.stats["spec_off_steps"] += bool(contexts) and not speculate
        return speculate

    def _propose(self, speculate: bool) -> None:
        """Speculative decoding: proposals for every running sequence whose tokens are all
        computed but the last (the scheduler turns it into a verify row) when the step
        speculates, none otherwise. A draft model's are placeholders until the schedule has
        reserved their pages (DraftProposer.propose)."""
        spec = self.ecfg.speculative
        if spec is None:
            return
        for seq in self.scheduler.running:
            if not speculate or seq.num_tokens - seq.num_computed_tokens > 1:
                seq.proposed_token_ids = []
            else:
                seq.proposed_token_ids = (self.draft.placeholders() if self.draft is not None else
                                          ngram.propose(seq.token_ids, spec.num_tokens, spec.ngram_min, spec.ngram_max))

    def _accept(self, proposals: list[int], sampled: list[SampleResult]) -> list[SampleResult]:
        """A verify row's accepted run: the sampled tokens while they equal the proposals, then
        the first that does not (or the one after the last proposal). Sampling every position
        from the target and keeping it while it equals the proposal is rejection sampling for a
        proposal that is certain (q one-hot, as n-gram lookup's): a proposal d is accepted with
        probability p(d), and a rejected position's token is drawn from p without d."""
        n = 0
        while n < len(sampled) - 1 and sampled[n].token == proposals[n]:
            n += 1
        if len(sampled) > 1:
            self.throttle.accepted(n)
            self.stats["spec_verify_rows"] += 1
            self.stats["spec_proposed_tokens"] += len(sampled) - 1
            self.stats["spec_accepted_tokens"] += n
        return sampled[:n + 1]

    def _detokenize(self, seqs: list[Sequence], tokens: dict[int, list[int]]) -> dict[int, list[str]]:
        """Each sequence's new `tokens`' texts by seq_id (IncrementalDetokenizer.step_runs); a stop
        token's too, kept only if asked for (`_advance`); texts past a stop go unused."""
        detoks = {q.seq_id: self._requests[q.request_id].detoks[q.index] for q in seqs
                  if self._requests[q.request_id].params.max_tokens}
        return IncrementalDetokenizer.step_runs({k: tokens[k] for k in detoks}, detoks)

    def _advance(self, req: Request, seq: Sequence, res: SampleResult, num_outputs: int,
                 text: str) -> CompletionOutput:
        """Take the new token (the sequence's num_outputs-th output) and its `text`, apply stop conditions
        (before min_tokens outputs the sampler bans the ending tokens, unless a grammar allows nothing
        else: one is then an ordinary token; stop strings wait too), return the delta. A stop
        token is in the delta's token ids and logprobs, as in vLLM; its text only with
        include_stop_str_in_output."""
        p, i, token = req.params, seq.index, res.token
        is_stop_token = token in seq.end_token_ids and num_outputs > p.min_tokens
        reason = "stop" if is_stop_token else None
        if not is_stop_token or p.include_stop_str_in_output:
            req.texts[i] += text
        if reason is None and p.stop and num_outputs >= p.min_tokens and req.cut_at_stop_string(i):
            reason = "stop"
        if reason is None and seq.grammar is not None and seq.grammar.accept(token):
            reason = "stop"   # the grammar is complete
        if reason is None and (num_outputs >= p.max_tokens or seq.num_prompt_tokens + num_outputs >= self.max_model_len):
            reason = "length"
        if reason is not None:
            if reason == "length":
                req.texts[i] += req.detoks[i].flush()
            self.scheduler.finish(seq, reason)
        return CompletionOutput(i, req.take_text(i, finished=reason is not None), [token],
                                [res] if p.logprobs is not None else None, reason)

    def _output(self, req: Request, outputs: list[CompletionOutput], finished: bool) -> RequestOutput:
        return RequestOutput(
            req.request_id, req.prompt_token_ids, outputs, finished, req.num_generated,
            req.arrival_time, req.first_token_time, time.monotonic() if finished else None,
            req.first_scheduled_time, req.seqs[0].num_cached_tokens or 0)
