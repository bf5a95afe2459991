"""Start one process per rank (gloo on 127.0.0.1) and collect what they report, with a bound
on wall time: a hang is killed and reported, never waited for."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(argv_of_rank, world: int, out: Path, timeout: float, env=None) -> tuple[bool, str]:
    """Run ``argv_of_rank(rank, port)`` for every rank; returns (all exited 0, logs).
    Every process is killed when ``timeout`` seconds pass."""
    out.mkdir(parents=True, exist_ok=True)
    port = free_port()
    e = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(world))
    e.update(GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    e.update(env or {})
    procs, logs = [], []
    for r in range(world):
        log = open(out / f"log-{r}.txt", "w")  # noqa: SIM115 (closed after the wait)
        logs.append(log)
        procs.append(
            subprocess.Popen(
                argv_of_rank(r, port),
                env=dict(e, RANK=str(r), LOCAL_RANK=str(r)),
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        )
    deadline = time.monotonic() + timeout
    hung = False
    while any(p.poll() is None for p in procs):
        if time.monotonic() > deadline:
            hung = True
            for p in procs:
                if p.poll() is None:
                    p.kill()
            break
        time.sleep(0.1)
    for p in procs:
        p.wait()
    for log in logs:
        log.close()
    text = "".join(
        f"--- rank {r} (exit {p.returncode}) ---\n" + (out / f"log-{r}.txt").read_text()[-3000:]
        for r, p in enumerate(procs)
    )
    if hung:
        text = f"TIMEOUT: killed after {timeout:.0f} s\n" + text
    return (not hung and all(p.returncode == 0 for p in procs)), text


def train_all(
    configs: list[dict], world: int, out: Path, timeout: float, worker: str = "torch_worker.py"
):
    """Run the training configurations in one launch of ``world`` processes of ``worker`` (a
    script next to this file); returns ({(name, rank): result}, ok, logs)."""
    out.mkdir(parents=True, exist_ok=True)
    cfg_path = out / "configs.json"
    cfg_path.write_text(json.dumps(configs))
    worker = str(HERE / worker)
    ok, logs = launch(
        lambda r, port: [
            sys.executable,
            worker,
            str(cfg_path),
            str(r),
            str(world),
            str(port),
            str(out),
        ],
        world,
        out,
        timeout,
    )
    results = {}
    for r in range(world):
        f = out / f"rank-{r}.jsonl"
        if f.exists():
            for line in f.read_text().splitlines():
                d = json.loads(line)
                results[(d["name"], d["rank"])] = d
    return results, ok, logs


def start_worker(argv: list[str]) -> tuple[list, int, int, str]:
    """In a worker started by :func:`launch` (argv: config file, rank, world, port, output):
    read its configurations and join the gloo process group. Returns (configs, rank, world,
    output path)."""
    from datetime import timedelta

    import torch.distributed as dist

    cfg_path, rank, world, port, out = argv
    rank, world = int(rank), int(world)
    with open(cfg_path) as f:
        configs = json.load(f)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=120),
    )
    return configs, rank, world, out
