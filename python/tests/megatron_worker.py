"""One rank of the Megatron-LM tests (launched by ``launch.py``, gloo on loopback, CPU only).

Builds a small megatron-core GPTModel (local layer spec, CPU initialization, float32) cut into
the stages of each configuration, trains it two steps and compares every microbatch loss and
every parameter gradient with Megatron's own ``forward_backward_no_pipelining`` on the full
model (same weights, same data), and, where a configuration names another one, with that
configuration's losses and gradients. A configuration runs either pipec's schedule through
``pipec.megatron.forward_backward_func`` or one of Megatron's own schedule functions.

megatron-core 0.19.2 runs on a CPU with the four test-only patches of ``megatron_cpu.py``;
every result line carries their hit counts.

Microbatches of different lengths (#38): a configuration with ``lengths`` (one list per step)
draws microbatch k of step s with ``lengths[s][k]`` tokens; a pipec run compiles a new schedule
for every step from that step's lengths (and ``order``, its ``microbatch_order``), as a training
loop that plans per step does, and a Megatron run sets ``variable_seq_lengths``. Every P2P op
posted through ``torch.distributed`` is recorded (``isend``/``irecv``, which
``batch_isend_irecv`` posts through too): a pipec run reports whether its messages were
exactly its plan's sends and receives with the plan's shapes, a Megatron run how many shape
messages it added.

Usage: python megatron_worker.py CONFIGS.json RANK WORLD PORT OUT_DIR
"""

from __future__ import annotations

import gc
import json
import os
import sys
import traceback
import weakref

import megatron_cpu  # the test-only CPU patches, before anything of Megatron runs
import pipec
import pipec.megatron as pm
import torch
import torch.distributed as dist
from launch import start_worker
from megatron.core import parallel_state
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.pipeline_parallel import schedules
from megatron.core.transformer.transformer_block import (
    LayerNormImpl,
    TransformerBlockSubmodules,
)
from megatron.core.transformer.transformer_config import TransformerConfig
from torch.distributed import distributed_c10d

HIDDEN, HEADS, VOCAB, SEQ, MBS = 16, 2, 32, 8, 2
STEPS, LR = 2, 0.1


def make_config(num_layers: int, pp: int, vpp: int | None, **p2p) -> TransformerConfig:
    if p2p.get("variable_seq_lengths"):
        # megatron-core 0.19.2 refuses variable_seq_lengths with its default MoE token
        # dispatcher ("allgather"), MoE or not.
        p2p["moe_token_dispatcher_type"] = "alltoall"
    cfg = TransformerConfig(
        num_layers=num_layers,
        hidden_size=HIDDEN,
        num_attention_heads=HEADS,
        use_cpu_initialization=True,
        pipeline_dtype=torch.float32,
        params_dtype=torch.float32,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=vpp,
        batch_p2p_sync=False,
        **p2p,
    )
    if cfg.batch_p2p_sync:
        raise AssertionError("patch 4 did not take: batch_p2p_sync is on")
    return cfg


def build(config: TransformerConfig, num_layers: int, pre: bool, post: bool, vp_stage=None):
    """Megatron's GPTModel with exactly ``num_layers`` decoder layers (the local layer spec),
    whatever the placement: a TransformerBlockSubmodules is taken as given by the block."""
    block = TransformerBlockSubmodules(
        layer_specs=[get_gpt_layer_local_spec()] * num_layers,
        layer_norm=LayerNormImpl,  # what Megatron's own block builder uses
    )
    return GPTModel(
        config=config,
        transformer_layer_spec=block,
        vocab_size=VOCAB,
        max_sequence_length=SEQ,
        pre_process=pre,
        post_process=post,
        share_embeddings_and_output_weights=False,
        vp_stage=vp_stage,
    )


def reference(num_layers: int) -> GPTModel:
    torch.manual_seed(1234)
    return build(make_config(num_layers, 1, None), num_layers, True, True)


def stage_state(ref_state: dict, lay: pm.StageLayers) -> dict:
    """The reference model's weights of one stage, under the stage model's names."""
    out = {}
    for k, v in ref_state.items():
        if k.startswith("decoder.layers."):
            i, rest = k[len("decoder.layers.") :].split(".", 1)
            if int(i) in lay.decoder_layers:
                out[f"decoder.layers.{lay.decoder_layers.index(int(i))}.{rest}"] = v
        elif k.startswith("embedding."):
            if lay.pre_process:
                out[k] = v
        elif k.startswith(("output_layer.", "decoder.final_layernorm.")):
            if lay.post_process:
                out[k] = v
        else:
            raise AssertionError(f"unexpected parameter {k}")
    return out


def data(step: int, m: int, lengths: list[int] | None = None) -> list:
    g = torch.Generator().manual_seed(100 + step)
    if lengths is not None:  # microbatch k has lengths[k] tokens
        return [
            (
                torch.randint(0, VOCAB, (MBS, n), generator=g),
                torch.randint(0, VOCAB, (MBS, n), generator=g),
            )
            for n in lengths
        ]
    tokens = torch.randint(0, VOCAB, (m, MBS, SEQ), generator=g)
    labels = torch.randint(0, VOCAB, (m, MBS, SEQ), generator=g)
    return [(tokens[i], labels[i]) for i in range(m)]


def position(n: int) -> torch.Tensor:
    return torch.arange(n).unsqueeze(0).expand(MBS, n)


def mask(n: int) -> torch.Tensor:
    return torch.triu(torch.ones(1, 1, n, n, dtype=torch.bool), diagonal=1)


# Every P2P op this process posts, while POSTED["on"]: (kind, shape, dtype). Megatron and
# pipec.megatron post through torch.distributed.isend / irecv, and batch_isend_irecv calls the
# op each P2POp names; the module's own names are replaced too, which P2POp checks ops against.
POSTED: dict = {"on": False, "ops": []}


def _recording(kind: str, fn):
    def posted(tensor, *a, **k):
        if POSTED["on"]:
            POSTED["ops"].append((kind, list(tensor.shape), str(tensor.dtype)))
        return fn(tensor, *a, **k)

    return posted


for _name in ("isend", "irecv"):
    _f = _recording(_name, getattr(distributed_c10d, _name))
    setattr(distributed_c10d, _name, _f)
    setattr(dist, _name, _f)


def planned_messages(sched, rank: int, m: int) -> list:
    """This rank's sends and receives as its plan gives them: (kind, shape, dtype), in stream
    order, the shape from the instruction's tokens (seq dimension), MBS and HIDDEN."""
    out = []
    for ins in sched.instructions(rank):
        kind = {"send": "isend", "recv": "irecv"}.get(ins.op.name)
        if kind is not None:
            out.append((kind, [ins.tokens, MBS, HIDDEN], "torch.float32"))
    return out


def make_forward_step(loss_mode: str, flags: list | None = None):
    def forward_step_func(data_iterator, model, *checkpoint):
        tokens, labels = next(data_iterator)
        n = tokens.shape[1]

        def call():
            return model(
                tokens if model.pre_process else None,
                position(n),
                mask(n),
                labels=labels if model.post_process else None,
            )

        # megatron-core passes checkpoint_activations_microbatch as a third argument only under
        # num_microbatches_with_partial_activation_checkpoints: recorded, and honoured by
        # checkpointing the whole model call (torch recomputes it inside the backward, from
        # the input tensor this forward was given: re-set, as a later forward replaces it).
        if checkpoint:
            flags.append(bool(checkpoint[0]))
        if checkpoint and checkpoint[0]:
            given = model.decoder.input_tensor

            def again():
                model.set_input_tensor(given)
                return call()

            out = torch.utils.checkpoint.checkpoint(again, use_reentrant=False)
        else:
            out = call()

        def loss_func(output, non_loss_data=False):
            if non_loss_data:  # collect_non_loss_data=True: anything the user wants back
                return output.detach().sum(dim=-1)
            if loss_mode == "per-token":  # (loss sum, tokens, ...): Megatron divides by both
                n = torch.tensor(output.numel(), dtype=torch.int)
                return output.sum(), n, {"lm loss": output.detach().mean()}
            loss = output.mean()
            return loss, {"lm loss": loss.detach()}

        return out, loss_func

    return forward_step_func


def poison_reloads() -> None:
    """From now on, every reload first adds 1 to the floating-point host copies it brings
    back: if the backward reads what was reloaded (the activations really went to the host),
    the gradients change. Used by one configuration, as this process's last."""
    from pipec import _offload

    reload = _offload.ActivationStore.reload

    def poisoned(self, stage, mb):
        for h in self._entries[(stage, mb)].managed():
            if h.host is not None and h.host.is_floating_point():
                h.host.add_(1.0)
        reload(self, stage, mb)

    _offload.ActivationStore.reload = poisoned


def max_abs(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).abs().max())


def value(entry) -> torch.Tensor:
    """What one microbatch returned: the loss dict's loss, or collected non-loss data."""
    return entry["lm loss"] if isinstance(entry, dict) else entry


def run(cfg: dict, rank: int, memo: dict) -> dict:
    pp = parallel_state.get_pipeline_model_parallel_world_size()
    lengths = cfg.get("lengths")  # per step, per microbatch
    if lengths is not None and "compile" in cfg:
        # A plan per step, from that step's lengths: compile the first one for the stage map.
        def plan(step):
            return pipec.compile(
                **cfg["compile"], lengths=lengths[step], microbatch_order=cfg.get("order")
            )

        sched = plan(0)
        mine = pm.stage_indices(sched, rank)
        layers = pm.stage_layers(sched)
        vpp = len(mine) if len(mine) > 1 else None
        m = sched.num_microbatches
        del sched
    elif "compile" in cfg or "dir" in cfg:
        # A sealed directory: a compiled schedule with memory instructions added (verified).
        sched = pipec.load(cfg["dir"]) if "dir" in cfg else pipec.compile(**cfg["compile"])
        mine = pm.stage_indices(sched, rank)
        layers = pm.stage_layers(sched)
        vpp = len(mine) if len(mine) > 1 else None
        func = pm.forward_backward_func(sched)
        m = sched.num_microbatches
    else:  # one of Megatron's own schedule functions, Megatron's placement
        vpp = cfg.get("vpp")
        kind = ("looped-bfs", {"vpp": vpp}) if vpp else ("gpipe", {})
        layers = pm.stage_layers(pipec.compile(kind[0], pp, 1, layout=cfg["layout"], **kind[1]))
        mine = [c * pp + rank for c in range(vpp or 1)]
        func = getattr(schedules, cfg["megatron"])
        m = cfg["microbatches"]
    num_layers = sum(lay.num_layers for lay in layers)
    ref = reference(num_layers)
    ref_state = ref.state_dict()
    n_ckpt = cfg.get("recompute")
    extra = (
        {} if n_ckpt is None else {"num_microbatches_with_partial_activation_checkpoints": n_ckpt}
    )
    config = make_config(num_layers, pp, vpp, **cfg.get("p2p", {}), **extra)
    chunks = []
    for c, st in enumerate(mine):
        lay = layers[st]
        chunk = build(config, lay.num_layers, lay.pre_process, lay.post_process, c if vpp else None)
        chunk.load_state_dict(stage_state(ref_state, lay))
        chunks.append(chunk)
    flags: list[bool] = []
    fstep = make_forward_step(cfg.get("loss", "mean"), flags)
    opt = torch.optim.SGD([p for ch in chunks for p in ch.parameters()], lr=LR)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=LR)
    loss_diff = grad_diff = 0.0
    n_losses = n_grads = 0
    record = {"losses": [], "grads": {}}
    holds_last = layers[-1].post_process and (len(layers) - 1) in mine
    fo, collect = cfg.get("forward_only", False), cfg.get("collect", False)
    if cfg.get("poison_reload"):
        poison_reloads()
    grad_mode = torch.no_grad() if fo else torch.enable_grad()
    megatron_cpu.SHAPE_SYNC["allowed"] = lengths is not None and "megatron" in cfg
    shape_syncs = megatron_cpu.HITS["shape_sync"]
    messages = {"plan_equal": [], "posted": 0, "shape_messages": 0}
    previous = None  # the last step's function, weakly: gone (with its plan) once dropped
    if lengths is not None:
        gc.disable()  # as Megatron-LM's --manual-gc: only reference counts free anything
    for step in range(STEPS):
        batch = data(step, m, None if lengths is None else lengths[step])
        opt.zero_grad()
        ref_opt.zero_grad()
        if lengths is not None and "compile" in cfg:
            func = None
            if previous is not None and previous() is not None:
                raise AssertionError(f"step {step}: the previous step's function is alive")
            sched = plan(step)
            func = pm.forward_backward_func(sched)
            want = planned_messages(sched, rank, m)
            previous = weakref.ref(func)
            del sched
        POSTED["on"], POSTED["ops"] = True, []
        with grad_mode:
            losses = func(
                forward_step_func=fstep,
                data_iterator=[iter(batch) for _ in chunks] if vpp else iter(batch),
                model=chunks if vpp else chunks[0],
                num_microbatches=m,
                seq_length=SEQ,
                micro_batch_size=MBS,
                forward_only=fo,
                collect_non_loss_data=collect,
            )
            POSTED["on"] = False
            posted = POSTED["ops"]
            messages["posted"] += len(posted)
            # Megatron's shape messages: the 3 int64 dimensions of the tensor that follows.
            messages["shape_messages"] += sum(1 for p in posted if p[2] == "torch.int64")
            if lengths is not None and "compile" in cfg:
                # pipec's: exactly the plan's, in the plan's order (each comm batch posts its
                # ops in stream order), with the plan's shapes; nothing else.
                messages["plan_equal"].append(posted == want)
                if posted != want:
                    messages["first_difference"] = next(
                        (i, a, b)
                        for i, (a, b) in enumerate(zip(posted + [None], want + [None]))
                        if a != b
                    )
            ref_losses = schedules.forward_backward_no_pipelining(
                forward_step_func=fstep,
                data_iterator=iter(batch),
                model=ref,
                num_microbatches=m,
                seq_length=SEQ,
                micro_batch_size=MBS,
                forward_only=fo,
                collect_non_loss_data=collect,
            )
        if holds_last:
            if len(losses) != m:
                raise AssertionError(f"step {step}: {len(losses)} loss entries for {m}")
            for a, b in zip(losses, ref_losses, strict=True):
                loss_diff = max(loss_diff, max_abs(value(a), value(b)))
                n_losses += 1
                record["losses"].append(float(value(a).sum()))
        elif losses:
            raise AssertionError(f"rank {rank} holds no last stage but returned {losses}")
        ref_params = dict(ref.named_parameters())
        for c, st in enumerate(mine):
            lay = layers[st]
            for name, p in chunks[c].named_parameters():
                rname = name
                if name.startswith("decoder.layers."):
                    i, rest = name[len("decoder.layers.") :].split(".", 1)
                    rname = f"decoder.layers.{lay.decoder_layers[int(i)]}.{rest}"
                q = ref_params[rname]
                if fo:
                    if p.grad is not None or q.grad is not None:
                        raise AssertionError(f"forward-only step {step}: {name} has a gradient")
                    continue
                if p.grad is None:
                    raise AssertionError(f"step {step}: stage {st} {name} has no gradient")
                grad_diff = max(grad_diff, max_abs(p.grad, q.grad))
                n_grads += 1
                record["grads"][f"{step}:{rname}"] = p.grad.clone()
        opt.step()
        ref_opt.step()
    if lengths is not None:
        gc.enable()
    megatron_cpu.SHAPE_SYNC["allowed"] = False
    record["flags"] = flags
    store = getattr(func, "pipec_memory", None)  # the offload store of pipec.megatron's run
    memo[cfg["name"]] = record
    result = {
        "flags": flags,
        "stages": mine,
        "losses_compared": n_losses,
        "grads_compared": n_grads,
        "loss_diff": loss_diff,
        "grad_diff": grad_diff,
        # The memory trace of the last step (pipec._offload.MemoryEvent rows).
        "memory_events": [list(e) for e in store.events] if store is not None else [],
        "messages": messages,
        "shape_syncs": megatron_cpu.HITS["shape_sync"] - shape_syncs,
    }
    other = cfg.get("compare_with")
    if other is not None:
        o = memo[other]
        result["vs_loss_diff"] = max(
            (abs(a - b) for a, b in zip(record["losses"], o["losses"], strict=True)), default=0.0
        )
        if record["grads"].keys() != o["grads"].keys():
            raise AssertionError(f"{other} has other parameters than {cfg['name']}")
        result["vs_grad_diff"] = max(
            (max_abs(v, o["grads"][k]) for k, v in record["grads"].items()), default=0.0
        )
        result["vs_flags"] = o["flags"]
    return result


def main() -> None:
    configs, rank, world, out = start_worker(sys.argv[1:6])
    parallel_state.initialize_model_parallel(
        pipeline_model_parallel_size=world, create_gloo_process_groups=False
    )
    log = open(os.path.join(out, f"rank-{rank}.jsonl"), "a")  # noqa: SIM115 (the process's life)
    memo: dict = {}
    for cfg in configs:
        try:
            res = dict(run(cfg, rank, memo), ok=True)
        except Exception as e:  # noqa: BLE001 (recorded, and the test reports it)
            res = {"ok": False, "error": f"{type(e).__name__}: {e}\n{traceback.format_exc()}"}
        res.update(name=cfg["name"], rank=rank, hits=dict(megatron_cpu.HITS))
        log.write(json.dumps(res) + "\n")
        log.flush()
        if not res["ok"]:
            break  # the other ranks may be stuck in this configuration's communication
    log.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
