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


def record_each(configs, rank: int, out: str, run_one, takes_part=lambda cfg: True) -> None:
    """In a worker: run ``run_one(cfg)`` for each configuration this rank ``takes_part`` in,
    appending its result (or the error) to ``<out>/rank-<r>.jsonl`` as soon as it is done, so a
    hang loses only the configuration it hit; every rank meets a barrier after each one. On an
    error the process exits at once: its peers may wait forever on it, and the launcher's
    timeout (or the peers' gloo timeout) ends the rest."""
    import time
    import traceback

    import torch.distributed as dist

    log = open(os.path.join(out, f"rank-{rank}.jsonl"), "a")  # noqa: SIM115 (the process's life)
    for cfg in configs:
        if takes_part(cfg):
            t0 = time.perf_counter()
            try:
                res = {"ok": True, **run_one(cfg)}
            except Exception as e:  # noqa: BLE001 (recorded, and the test reports it)
                res = {"ok": False, "error": f"{type(e).__name__}: {e}"}
                traceback.print_exc()
            res.update(name=cfg["name"], rank=rank, seconds=time.perf_counter() - t0)
            log.write(json.dumps(res) + "\n")
            log.flush()
            if not res["ok"]:
                os._exit(1)
        dist.barrier()
    dist.destroy_process_group()


def train_csv_recipes(cases, framework: str, path: str, out: Path, tol: float) -> tuple:
    """Train each ``(name, compile kwargs, schedule name)`` case at pp=2, M=4 from pipec's
    compute-only CSV through ``framework``'s own schedule builder (torch_worker.py's
    ``torchtitan`` / ``automodel`` configs), with ``path`` (the framework's ``--no-deps``
    install) on PYTHONPATH; :func:`train_all`'s result."""
    import pipec

    configs = []
    for name, kw, cls in cases:
        sched = pipec.compile(pp=2, microbatches=4, **kw)
        csv = out / f"{name}.csv"
        csv.write_text(sched.to_torch_csv(compute_only=True))
        configs.append(
            {
                "name": name,
                "pp": 2,
                "tol": tol,
                "compile": dict(kw, pp=2, microbatches=4),
                framework: cls,
                "csv": str(csv),
            }
        )
    old = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = path + (os.pathsep + old if old else "")
    try:
        return train_all(configs, 2, out, 300)
    finally:
        if old is None:
            del os.environ["PYTHONPATH"]
        else:
            os.environ["PYTHONPATH"] = old


def rank_results(trained, name: str, world: int = 2) -> list[dict]:
    """Each rank's result of config ``name``, failing the test on a hang or an error."""
    import pytest

    results, _, logs = trained
    got = []
    for r in range(world):
        res = results.get((name, r))
        if res is None:
            pytest.fail(f"{name}: rank {r} reported nothing (hang or crash)\n{logs}")
        if not res["ok"]:
            pytest.fail(f"{name}: rank {r}: {res['error']}\n{logs}")
        got.append(res)
    return got
