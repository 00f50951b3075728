"""The sample "trainer" the demo publishes as an artifact (its source is copied
into the artifact tree as ``train.py``; it must run with the stdlib alone).

It prints its rank, GPUs and peers, writes a checkpoint every second to its scratch
dir (through ``durable.py``, a copy of :mod:`infra.durable` shipped beside it), and on
SIGTERM saves a final checkpoint (reason taken from the preemption notice file) and
exits 0. With ``--steps N`` it finishes by itself after N steps.
"""

TRAINER_SOURCE = r'''#!/usr/bin/env python3
"""herd demo trainer: a stand-in for a training job (simulated GPUs, no CUDA)."""
import json, os, signal, sys, time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from durable import atomic_write  # herd's infra/durable.py, copied next to this file (stdlib only)

VERSION = "@VERSION@"
stop = {"sig": None}


def on_term(signum, frame):
    stop["sig"] = signum


def notice():
    path = os.environ.get("HERD_PREEMPT_NOTICE", "")
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return {}


def save(scratch, step, final, reason=None):
    doc = {"step": step, "final": final, "time": time.time(), "version": VERSION,
           "rank": int(os.environ.get("HERD_RANK", "0")), "reason": reason}
    name = "final.json" if final else "ckpt-%04d.json" % step
    atomic_write(os.path.join(scratch, name), json.dumps(doc).encode(), 0o644)


def main():
    steps = None
    if "--steps" in sys.argv:
        steps = int(sys.argv[sys.argv.index("--steps") + 1])
    signal.signal(signal.SIGTERM, on_term)
    scratch = os.environ.get("HERD_SCRATCH", ".")
    weights = os.path.join(os.path.dirname(os.path.abspath(__file__)), "weights.bin")
    size = os.path.getsize(weights) if os.path.exists(weights) else 0
    print("trainer %s rank=%s/%s job=%s gpus=%s peers=%s weights=%dB" % (
        VERSION, os.environ.get("HERD_RANK"), os.environ.get("HERD_WORLD_SIZE"),
        os.environ.get("HERD_JOB_ID"), os.environ.get("CUDA_VISIBLE_DEVICES"),
        os.environ.get("HERD_PEERS", ""), size), flush=True)
    step = 0
    while stop["sig"] is None:
        if steps is not None and step >= steps:
            save(scratch, step, final=True, reason="completed")
            print("trainer finished after %d steps" % step, flush=True)
            return 0
        deadline = time.monotonic() + 1.0
        while stop["sig"] is None and time.monotonic() < deadline:
            time.sleep(0.02)
        if stop["sig"] is None:
            step += 1
            save(scratch, step, final=False)
    n = notice()
    save(scratch, step, final=True, reason=n.get("reason", "sigterm"))
    print("trainer got SIGTERM at step %d (%s); final checkpoint saved" % (step, n.get("reason")), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
'''


def trainer_source(version: str) -> str:
    return TRAINER_SOURCE.replace("@VERSION@", version)


def durable_source() -> str:
    """The source of :mod:`infra.durable` (standard library only), shipped beside
    ``train.py`` as ``durable.py`` so the trainer's checkpoints go through the same
    atomic write as herd's own files."""
    import inspect

    from infra import durable

    return inspect.getsource(durable)
