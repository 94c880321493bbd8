"""`rlft train --nproc N`: check the run once, start torchrun, and own its lifetime.

- Before any rank starts, the launcher loads the config, checks what is cheap to check (the late
  settings, the data files, the model's config.json, the number of devices) and prints the memory
  plan's warning once: a mistake is one `error:` line, not N copies of it and torchrun's traceback.
- torchrun runs in its own process group, so a Ctrl-C in the terminal reaches the launcher alone,
  which passes the first SIGINT / SIGTERM to torchrun, and torchrun to every rank: each rank stops
  after its step and saves its part of the checkpoint, as a single process does. A second one goes
  straight to the ranks (stop now, without saving).
- torchrun gets SIGTERM when the launcher dies (rlft/training/torchrun.py), and every rank watches its own
  parent (`distributed.watch_parent`): a killed launcher or torchrun leaves no rank behind.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

from rlft.config import Config, load_config
from rlft.errors import ConfigError

# set for the ranks of a launch whose checks the launcher already made (they skip the repeats)
CHECKED_ENV = "RLFT_LAUNCH_CHECKED"


def check_launch(config: Config, nproc: int) -> None:
    """What every rank would find out for itself, found once: raises an RlftError for a mistake
    and prints the memory plan's warning (all N ranks of this machine count against its RAM on
    CPU; each rank has its own GPU on CUDA)."""
    from rlft.data.fingerprint import training_sources
    from rlft.data.readers import check_source
    from rlft.models.gguf import gguf_source
    from rlft.models.loading import resolve_device
    from rlft.monitor.catalogue import preflight
    from rlft.plan.inputs import read_model_config

    device = resolve_device(config.model.device)
    check_devices(nproc, device.type)
    if config.model.quantization != "none":  # FSDP2 cannot shard bitsandbytes' packed parameters
        raise ConfigError("model.quantization=4bit trains on one GPU; run without --nproc / torchrun")
    if nproc > 1 and config.rollout.async_steps:
        from rlft.training.online.rollouts import check_async_ranks

        check_async_ranks(config)
    preflight(config)
    for name, source in training_sources(config) + [("data.eval", config.data.eval)] + \
            [(f"eval.suites.{s.name}", s.data) for s in config.eval.suites]:
        if source is not None:
            check_source(source, name)
    if gguf_source(config.model.path, config.model.gguf_file) is None:  # (a GGUF source is checked by that)
        read_model_config(config.model.path, config.model.revision, config.model.trust_remote_code)
    # a plan that cannot fit stops here, before any rank starts; what fits is chosen (and said) by the
    # ranks themselves, which all choose the same
    from rlft.plan.fit import fit_memory
    from rlft.training.distributed import SINGLE

    fit_memory(config, SINGLE, device, local_ranks=nproc, world_size=nproc)


def check_devices(nproc: int, device_type: str) -> None:
    """One rank per GPU on CUDA; on CPU no more ranks than the cores this process may use (more
    only slow each other down, and a typo like --nproc 64 would start 64 model copies)."""
    if device_type == "cuda":
        import torch

        have, what = torch.cuda.device_count(), "GPU(s)"
    else:
        have = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        what = "CPU core(s)"
    if nproc > have:
        raise ConfigError(f"--nproc {nproc} is more processes than this machine's {have} {what} ({device_type}); "
                          f"fix: --nproc {have} or fewer (several machines: torchrun --nnodes, see docs/guides/scaling.md#several-machines)")


def run_torchrun(nproc: int, entry: list[str], grace_s: float) -> int:
    """`torchrun --standalone --nproc-per-node N ENTRY` (through rlft/training/torchrun.py; ENTRY: `-m rlft
    train ...`), its exit status (128 + the signal's number when the launcher was stopped by one).
    --standalone: a free port of its own, so two runs on one machine do not meet at torchrun's
    default 29500."""
    from rlft.training.torchrun import LAUNCHER_ENV

    command = [sys.executable, "-m", "rlft.training.torchrun", "--standalone", "--nproc-per-node", str(nproc), *entry]
    env = {**os.environ, CHECKED_ENV: "1", LAUNCHER_ENV: str(os.getpid())}
    # torchrun SIGKILLs the ranks still running this long after its SIGTERM: `grace_s` to finish a
    # step and save (training.dist_timeout_s, the longest a collective may take anyway)
    env.setdefault("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", str(int(grace_s)))
    proc = subprocess.Popen(command, env=env, start_new_session=True)  # Ctrl-C reaches it through forward()
    received: list[int] = []

    def forward(signum: int, frame: object) -> None:
        if not received:  # torchrun passes it to every rank, which saves and stops
            proc.send_signal(signum)
        else:  # the second: straight to the ranks, which stop at once without saving
            for pid in children(proc.pid):
                _kill(pid, signum)
        received.append(signum)

    saved = {sig: signal.signal(sig, forward) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        code = proc.wait()
    finally:
        for sig, handler in saved.items():
            signal.signal(sig, handler)
    return 128 + received[0] if received else code


def children(pid: int) -> list[int]:
    """The processes whose parent is `pid` (Linux /proc; none elsewhere)."""
    out = []
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        # the fields after the command's closing parenthesis: state, ppid, ...
        if int(stat.rpartition(")")[2].split()[1]) == pid:
            out.append(int(entry.name))
    return out


def _kill(pid: int, signum: int) -> None:
    try:
        os.kill(pid, signum)
    except ProcessLookupError:
        pass


def launch_config(config: Path | None, overrides: list[str], resume: Path | None) -> Config:
    """The config the ranks will train with (`rlft train` / `--resume`'s own rules)."""
    from rlft.api import resume_config

    if resume is not None:
        path, extra = resume_config(resume, ([str(config)] if config else []) + overrides)
        return load_config(path, extra)
    if config is None:
        raise ConfigError("give a config file (rlft train CONFIG.yaml) or --resume RUN_DIR")
    return load_config(config, overrides)

