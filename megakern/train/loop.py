"""The training loop (Loop): steps until train.steps, with the checks between steps (the data files unchanged, the
ranks' vote on stopping), evals and checkpoints when due, each as a phase of the step watchdog over several ranks;
then the final eval, checkpoint and sample. The figures of a step are read once the next step is queued, so the log,
the count of skipped steps and a halt run one step behind the device."""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch

from megakern.config import ConfigError
from megakern.data import DataError
from megakern.train.figures import StepClock, StepFigures
from megakern.train.log import format_count, memory_gib
from megakern.train.profile import make_profiler, past_capture, write_profile
from megakern.train.stopping import EXIT_INTERRUPTED


class TrainingHalted(RuntimeError):
    """The run stopped on purpose (too many non-finite steps); the message says why and what to try."""


def _agreed(exc: Exception) -> Exception:
    """Mark an error that every rank raises alike, from a vote (the step watchdog has nothing to diagnose)."""
    exc.agreed = True
    return exc


@dataclass
class RunResult:
    """What ``Trainer.run`` returns: per-step training losses, eval losses, counters and the final sample."""

    losses: dict[int, float] = field(default_factory=dict)   # step (1-based) -> loss, skipped steps included
    eval_losses: dict[int, float] = field(default_factory=dict)
    skipped_steps: list[int] = field(default_factory=list)
    final_step: int = 0
    checkpoint: str | None = None
    sample: str | None = None
    profile_dir: str | None = None
    stopped_by: str | None = None  # 'SIGTERM' / 'SIGINT' when a signal stopped the run (after saving)


class Loop:
    """One run of a Trainer's loop (``run``), and what it keeps between steps: the vote in flight, the run of
    skipped steps, the figures since the last log line, the step watchdog."""

    def __init__(self, trainer):
        self.trainer = trainer
        self.vote_in_flight = self.watchdog = None
        self.consecutive, self.window = 0, [0, 0, []]  # window: ns, tokens, losses since the last log line

    def between_steps(self, sync: bool = False) -> str | None:
        """After every step, on every rank alike: the data files unchanged here (a stat) and the ranks' vote on
        stopping (megakern.stopping). Over several ranks a step's vote is read after the next step is queued, so
        its latency hides behind that step (a signal or a change stops the run one step later); ``sync`` (before a
        checkpoint, at the run's end) settles the vote in flight and votes now. A change any rank sees raises
        DataError on every rank, naming the file and the rank. Returns the signal that stops the run (received by
        any rank), or None."""
        t = self.trainer
        error = None
        try:
            t.data.train.check_unmodified()
            t.data.valid.check_unmodified()
        except DataError as exc:
            error = str(exc)
        if t.vote is None:
            return None
        votes = [self.vote_in_flight.result()] if self.vote_in_flight is not None else []
        self.vote_in_flight = None
        if sync or t.env.world == 1:  # (one process: the vote is its own, at once)
            votes.append(t.vote.agree(t.signals.received, error))
        else:
            self.vote_in_flight = t.vote.start(t.signals.received, error)
        errors = {r: m for v in votes for r, m in (v.errors or {}).items()}
        if errors:
            where = "; ".join(f"rank {r}: {m}" if t.env.world > 1 else m for r, m in sorted(errors.items()))
            raise _agreed(DataError(f"{where}; stopped after step {t.step}, no checkpoint of it written"))
        voted = next((v for v in votes if v.signal), None)
        if voted is None:
            return None
        if voted.signal_rank is not None and not t.signals.received:
            t.log(f"rank {voted.signal_rank} received {voted.signal}")
        return voted.signal

    def run(self) -> RunResult:
        t = self.trainer
        c, result = t.config, RunResult()
        first_step = t.step
        if t.step >= c.train.steps:
            t.log(f"nothing to do: step {t.step} >= train.steps {c.train.steps}")
        batches = t.batches(t.data.train, t.consumed_samples, t.draw)
        profiler = last = None
        if t.profiling:
            lg, note = past_capture(c.log, c.train.cuda_graph_warmup if t.graph is not None else None)
            if note:
                t.log(note)
            profiler = make_profiler(lg, t.device)
            last = t.step + lg.profile_wait + lg.profile_warmup + lg.profile_active
        clock = StepClock(t.device)
        t.stepper.set_training(True)
        if t.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(t.device)
        t.signals.graceful = True  # from here a first signal finishes the step and saves (stopping.py)
        self.watchdog = self.start_watchdog()
        try:
            return self._steps(result, batches, profiler, last, clock, first_step)
        finally:
            t.signals.graceful = False
            if self.watchdog is not None:
                self.watchdog.close()
                self.watchdog = None

    def _steps(self, result: RunResult, batches, profiler, last, clock: StepClock, first_step: int) -> RunResult:
        """The steps, then the final eval, checkpoint and sample (``run`` sets up). ``pending``: the step whose
        figures are still on their way, read once the next step is queued. Each step, eval and save is a phase of
        the step watchdog (over several ranks)."""
        t = self.trainer
        c, pending, stop = t.config, None, None
        try:
            if profiler is not None:
                profiler.start()
            while t.step < c.train.steps and (last is None or t.step < last):
                with self.watched("step", t.step + 1):
                    clock.begin()
                    figures = t.train_step(batches)
                    lr = t.schedule(t.step)
                    t.step += 1
                    t.consumed_samples += t.global_batch
                    figures.time = clock.end()
                    if profiler is not None:
                        profiler.step()
                    if pending is not None:  # the previous step's figures: read now that this step is queued
                        self.report(result, *pending)
                    pending = (figures, lr)
                    due_eval = c.eval.every and t.step % c.eval.every == 0 and t.step < c.train.steps
                    due_save = (c.checkpoint.every and t.step % c.checkpoint.every == 0
                                and t.step < c.train.steps)
                    # (before a checkpoint, and at the last step, the vote is settled now)
                    stop = self.between_steps(sync=bool(due_save) or t.step >= c.train.steps
                                               or (last is not None and t.step >= last))
                    if t.step == first_step + 1 and not stop and profiler is None and self.eval_is_larger():
                        self.report(result, *pending)  # (the probe may stop the run: step 1 is logged first)
                        pending = None
                        self.check_eval_memory()
                        clock.pause()
                    if stop or (profiler is None and (due_eval or due_save)):
                        self.report(result, *pending)
                        pending = None
                if stop:
                    break
                if profiler is None and (due_eval or due_save):
                    if due_eval:
                        with self.watched("eval", t.step):
                            self.eval(result)
                    if due_save:
                        with self.watched("checkpoint", t.step):
                            result.checkpoint = str(t.save())
                    clock.pause()  # eval and saving are not training time
            if pending is not None:
                with self.watched("step", t.step):
                    self.report(result, *pending)
        finally:
            if profiler is not None:
                profiler.stop()
        result.final_step = t.step
        if stop:
            return self.stop_on_signal(result, stop, first_step, profiler is not None)
        if profiler is not None:
            result.profile_dir = str(write_profile(profiler, c, device=t.device, global_batch=t.global_batch,
                                                   seq_length=t.seq_length, precision=t.precision, log=t.log))
            return result
        if t.step == first_step:
            return result
        if c.eval.every:
            with self.watched("eval", t.step):
                self.eval(result)
        with self.watched("checkpoint", t.step):
            if c.checkpoint.final or (c.checkpoint.every and t.step % c.checkpoint.every == 0):
                self.between_steps(sync=True)  # (eval read the files too: checked again before a checkpoint)
                result.checkpoint = str(t.save(asynchronous=False))
            t.manager.wait()  # a background save still running: the run is done when it is (its failure raises)
        result.sample = t.sample()
        if result.sample is not None:
            t.log(f"sample ({len(result.sample)} characters after {c.train.sample_prompt!r}):\n"
                  f"{c.train.sample_prompt}{result.sample}")
            t.logger.text("sample", c.train.sample_prompt + result.sample, t.step)
        return result

    def start_watchdog(self):
        """Over several ranks, unless parallel.step_timeout_s is null: the step watchdog
        (megakern.parallel.watchdog), which names the ranks a hung step waits for and ends every rank (exit code
        124). The first steps (compilation; with a CUDA graph, its warm-up and capture), evals and saves get
        parallel.init_timeout_s."""
        t = self.trainer
        c, p = t.config, t.config.parallel
        if t.env.world == 1 or p.step_timeout_s is None:
            return None
        from megakern.parallel import StepWatchdog

        timeout = min(p.step_timeout_s, 0.9 * p.init_timeout_s)  # before the collectives' own timeout
        if timeout < p.step_timeout_s:
            t.log(f"note: the step watchdog times steps out after {timeout:g} s, 90% of parallel.init_timeout_s "
                  f"(parallel.step_timeout_s is {p.step_timeout_s:g})")
        return StepWatchdog(t.env.mesh, timeout_s=timeout, first_timeout_s=0.9 * p.init_timeout_s,
                            log=t.log if t.env.writer else None,
                            first_steps=c.train.cuda_graph_warmup + 1 if c.train.cuda_graph else 1,
                            on_timeout=lambda text: t.logger.close(failed=True)).start()

    @contextlib.contextmanager
    def watched(self, name: str, step: int):
        """One phase of the step watchdog (a step, an eval, a checkpoint save); nothing without one. An error that
        every rank raises alike (a vote's, a halt on the reduced figures: ``agreed``) ends the phase plainly; any
        other goes through the watchdog, which names what the other ranks were doing."""
        if self.watchdog is None:
            yield
            return
        self.watchdog.begin_phase(name, step)
        try:
            yield
        except Exception as exc:
            if isinstance(exc, TrainingHalted) or getattr(exc, "agreed", False):
                self.watchdog.end_phase(name, step)
            else:
                self.watchdog.failed(exc)
            raise
        self.watchdog.end_phase(name, step)

    def eval_is_larger(self) -> bool:
        """Whether eval runs on a CUDA device with micro-batches of more tokens than training's (check_eval_memory)."""
        t = self.trainer
        c = t.config
        return bool(c.eval.every) and t.device.type == "cuda" and (
            t.eval_mbs * t.eval_seq_length > c.train.micro_batch_size * t.seq_length)

    def check_eval_memory(self) -> None:
        """Contract 28 (docs/contracts.md): when eval's micro-batches hold more tokens than training's (a longer
        eval.seq_length or a larger eval.micro_batch_size) on a CUDA device, one eval micro-batch runs right after
        the run's first step, when the optimizer's state and the allocator's pools exist: running out of memory
        there stops the run now with the keys to change, rather than at the first eval, perhaps hours in. Every
        rank agrees (one rank's failure stops all)."""
        t = self.trainer
        c = t.config
        error = None
        try:
            t.evaluate(batches=1)
        except torch.cuda.OutOfMemoryError as exc:
            torch.cuda.empty_cache()
            error = (f"eval's micro-batch of {t.eval_mbs} x {t.eval_seq_length} tokens (training's: "
                     f"{c.train.micro_batch_size} x {t.seq_length}) does not fit in the memory training leaves "
                     f"({str(exc).splitlines()[0]}); lower eval.micro_batch_size or eval.seq_length")
        vote = t.vote.agree(None, error)
        if vote.errors:
            raise _agreed(ConfigError("; ".join(f"rank {r}: {m}" if t.env.world > 1 else m
                                                for r, m in sorted(vote.errors.items()))))
        t.log(f"eval memory: a micro-batch of {t.eval_mbs} x {t.eval_seq_length} tokens fits beside "
              f"training ({memory_gib(t.device)[0]:.2f} GiB peak)")

    def stop_on_signal(self, result: RunResult, signal_name: str, first_step: int, profiling: bool) -> RunResult:
        """The loop stopped on ``signal_name`` after a complete step: save (every rank), log, and say how to go on."""
        t = self.trainer
        result.stopped_by = signal_name
        if profiling or t.step == first_step:
            why = "profiling" if profiling else f"no step was trained since step {first_step}"
            t.log(f"stopped by {signal_name} after step {t.step}: no checkpoint written ({why})")
            return result
        t.log(f"{signal_name}: step {t.step} finished; saving a checkpoint before stopping")
        with self.watched("checkpoint", t.step):
            self.between_steps(sync=True)  # the vote still in flight settled: the files checked up to this step
            result.checkpoint = str(t.save(asynchronous=False))
        t.log(f"stopped by {signal_name} after step {t.step}: checkpoint {result.checkpoint}; continue with "
              f"checkpoint.resume={t.ckpt_dir} (exit code {EXIT_INTERRUPTED})")
        return result

    def report(self, result: RunResult, figures: StepFigures, lr: float) -> None:
        """Read one step's figures (waiting for that step only), count a skipped step (TrainingHalted after
        train.max_nonfinite in a row), log and record them, with the step's own duration."""
        t = self.trainer
        c, step = t.config, figures.step
        loss, norm, stepped = figures.read()
        moe = t.stepper.moe.summary(figures.extra) if t.stepper.moe is not None else None
        elapsed = figures.time.ns() if figures.time is not None else 0
        result.losses[step] = loss
        if not stepped:
            self.consecutive += 1
            t.nonfinite_total += 1
            result.skipped_steps.append(step)
            routers = (f", {moe['nonfinite_logits']:.0f} non-finite MoE router logits"
                       if moe is not None and moe["nonfinite_logits"] else "")
            t.log(f"step {step}: non-finite loss {loss} or gradient norm {norm}{routers}; step skipped "
                  f"({self.consecutive} in a row, {t.nonfinite_total} in all)")
            if self.consecutive >= c.train.max_nonfinite:
                raise TrainingHalted(
                    f"{self.consecutive} steps in a row (steps {step - self.consecutive + 1}..{step}) had a "
                    f"non-finite loss or gradient norm (train.max_nonfinite={c.train.max_nonfinite}); "
                    f"stopping. Try a lower optim.lr (now {c.optim.lr:g}) or longer schedule.warmup_steps, "
                    f"train.grad_clip, or check the data; the last checkpoint is in {t.ckpt_dir}")
        else:
            self.consecutive = 0
        window = self.window
        window[0] += elapsed
        window[1] += t.tokens_per_step
        window[2].append(loss)
        tok_s = window[1] / (max(window[0], 1) / 1e9)
        mfu = (t.flops_per_token * tok_s / t.env.world / t.peak) if t.peak else None
        mem, mem_what = memory_gib(t.device)
        t.logger.progress(step, f"loss {loss:.4f} lr {lr:.2e} {format_count(tok_s)} tok/s MFU "
                          f"{'n/a' if mfu is None else f'{100 * mfu:.1f}%'} {mem:.2f} GiB"
                          + (f" MoE imbalance {moe['imbalance']:.2f}" if moe is not None else ""))
        scalars = {"train/loss": loss, "train/lr": lr, "train/grad_norm": norm, "perf/tokens_per_s": tok_s,
                   "perf/mfu": mfu, "perf/memory_gib": mem, "perf/step_ms": elapsed / 1e6}
        if moe is not None:
            scalars.update({f"moe/{k}": v for k, v in moe.items()})
        t.logger.record(step, scalars)
        if step % c.log.every == 0 or step == c.train.steps:
            experts = ""
            if moe is not None:
                experts = (f" | MoE tokens/expert {moe['tokens_per_expert_min']:.0f}..{moe['tokens_per_expert_max']:.0f}"
                           f" (mean {moe['tokens_per_expert_mean']:.0f}) imbalance {moe['imbalance']:.2f} dropped "
                           f"{100 * moe['dropped']:.1f}% aux {moe['aux_loss']:.4f} z {moe['z_loss']:.4f}")
            t.log(f"step {step:>6}/{c.train.steps} | loss {sum(window[2]) / len(window[2]):.4f} | "
                  f"lr {lr:.3e} | grad norm {norm:.3f} | {format_count(tok_s)} tok/s | MFU "
                  f"{'n/a' if mfu is None else f'{100 * mfu:.1f}%'} | {mem_what} {mem:.2f} GiB{experts}")
            self.window = [0, 0, []]

    def eval(self, result: RunResult) -> None:
        t = self.trainer
        loss = float(t.evaluate())
        result.eval_losses[t.step] = loss
        t.logger.record(t.step, {"eval/loss": loss})
        t.log(f"step {t.step:>6} | eval loss {loss:.4f} (held out, {t.config.eval.batches} x "
              f"{t.eval_mbs} x {t.eval_seq_length})")
