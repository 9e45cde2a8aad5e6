"""What ``seqpar train`` prints and writes on rank 0: a progress bar, human lines, JSON lines, the end
summary and the loss plot."""

from __future__ import annotations

import contextlib
import json
import math
import sys

from .config import TrainConfig

# fields that may hold a non-finite number (a diverged loss, an overflowing gradient norm): written as
# null, which every strict JSON parser reads (NaN and Infinity are not JSON); any other non-finite
# value is a bug and json.dumps(allow_nan=False) raises on it
NULLABLE = ("loss", "grad_norm", "eval_loss", "eval_ppl", "final_loss", "final_eval_loss")


def _finite(value) -> bool:
    return not isinstance(value, float) or math.isfinite(value)


def strict_record(record: dict) -> dict:
    """``record`` with the non-finite floats of :data:`NULLABLE` fields replaced by None (null), and
    those of the start record's ``config`` (``--timeout inf``) by their text ("inf")."""
    out = {k: None if k in NULLABLE and not _finite(v) else v for k, v in record.items()}
    if isinstance(out.get("config"), dict):
        out["config"] = {k: v if _finite(v) else str(v) for k, v in out["config"].items()}
    return out


class TrainLog:
    """Rank 0's output: a progress bar, human lines, JSON lines."""

    def __init__(self, cfg: TrainConfig, active: bool, start: int, resumed: bool):
        self.active, self.cfg = active, cfg
        self.stream = sys.stderr if cfg.json == "-" else sys.stdout
        self.json = None
        if active and cfg.json:
            self.json = sys.stdout if cfg.json == "-" else open(cfg.json, "a" if resumed else "w")
        self.bar = None
        if active and cfg.progress and cfg.json != "-":
            with contextlib.suppress(ImportError):
                from tqdm.auto import tqdm

                self.bar = tqdm(total=cfg.steps, initial=start, unit="step", dynamic_ncols=True, leave=True)

    def info(self, message: str) -> None:
        if not self.active:
            return
        if self.bar is not None:
            self.bar.write(message, file=self.stream)
        else:
            print(message, file=self.stream, flush=True)

    def event(self, record: dict) -> None:
        if self.json is not None:
            self.json.write(json.dumps(strict_record(record), allow_nan=False) + "\n")
            self.json.flush()

    def step(self, rec: dict) -> None:
        if not self.active:
            return
        self.event(rec)
        if self.bar is not None:
            self.bar.update(1)
            self.bar.set_postfix(loss=f"{rec['loss']:.4f}", tok_s=f"{rec['tokens_per_s']:.0f}")
        if rec["step"] % self.cfg.log_every == 0 or rec["step"] == self.cfg.steps:
            self.info(f"step {rec['step']:>5}/{self.cfg.steps} | loss {rec['loss']:.4f} | lr {rec['lr']:.2e} | "
                      f"{rec['tokens_per_s']:,.0f} tok/s | {rec['step_time_s'] * 1e3:,.0f} ms | "
                      f"peak mem {rec['peak_mem_mib']:,.0f} MiB"
                      + (f" | MFU {rec['mfu']:.1%}" if rec.get("mfu") is not None else "")
                      + (f" | loss scale {rec['loss_scale']:g}" if "loss_scale" in rec else "")
                      + (" (overflow: step skipped)" if rec.get("skipped") else ""))

    def evaluation(self, rec: dict) -> None:
        """An evaluation's record and line (:func:`.evaluate.evaluate`)."""
        if not self.active:
            return
        self.event(rec)
        self.info(f"eval {rec['step']:>5}/{self.cfg.steps} | eval loss {rec['eval_loss']:.4f} | ppl "
                  f"{rec['eval_ppl']:,.2f} | {rec['eval_sequences']} sequences, {rec['eval_tokens']:,} tokens | "
                  f"{rec['eval_s']:.1f} s")

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        if self.json is not None and self.json is not sys.stdout:
            self.json.close()


def summary(log: TrainLog, result, extra: dict | None = None) -> None:
    """The end line and the end record (``extra`` added to it: ``optim_bytes_local``, ...)."""
    ran = [r for r in result.history if r["step"] > result.start_step]
    if not ran:
        log.info(f"nothing to do: the checkpoint is at step {result.start_step}")
        return
    timed = ran[1:] or ran  # the first step pays one-off start-up costs
    tps = sum(r["tokens"] for r in timed) / sum(r["step_time_s"] for r in timed)
    median = sorted(r["tokens_per_s"] for r in timed)[len(timed) // 2]  # robust on a shared machine
    per_cpu_s = sum(r["tokens"] for r in timed) / max(sum(r.get("cpu_s", 0.0) for r in timed), 1e-9)
    log.info(f"done: step {ran[-1]['step']}, loss {ran[0]['loss']:.4f} -> {ran[-1]['loss']:.4f}, "
             f"{median:,.0f} tok/s median ({tps:,.0f} mean) after step 1, {per_cpu_s:,.0f} tokens per CPU-second "
             f"(all ranks), peak mem {max(r['peak_mem_mib'] for r in ran):,.0f} MiB per rank"
             + (f", {extra['skipped_steps']} of {len(ran)} step(s) skipped for inf/NaN gradients (loss scale now "
                f"{extra['loss_scale']:g})" if extra and "skipped_steps" in extra else "")
             + (f", eval loss {extra['final_eval_loss']:.4f}" if extra and "final_eval_loss" in extra else ""))
    log.event({"event": "end", "tokens_per_s": tps, "tokens_per_s_median": median,
               "tokens_per_cpu_s": per_cpu_s, "final_loss": ran[-1]["loss"], "checkpoint": result.checkpoint,
               **(extra or {})})


def plot_losses(history: list[dict], path: str, evals: list[dict] | None = None) -> None:
    """The training loss per step, and the evaluations' losses (``evals``) as points over it."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("seqpar train: --plot needs matplotlib (pip install 'seqpar[bench]'); no plot written", file=sys.stderr)
        return
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot([r["step"] for r in history], [r["loss"] for r in history], marker="." if len(history) < 60 else None,
            label="train")
    if evals:
        ax.plot([r["step"] for r in evals], [r["eval_loss"] for r in evals], "o--", label="eval (held-out)")
        ax.legend()
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats / token)")
    ax.set_title("seqpar train")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


__all__ = ["NULLABLE", "TrainLog", "plot_losses", "strict_record", "summary"]
