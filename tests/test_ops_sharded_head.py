"""Fused head ops with an FSDP2-sharded LM-head weight (a DTensor), 2 processes on gloo, float64.

Loss and gradients of ``linear_logprobs``, ``linear_entropy`` and ``linear_cross_entropy`` with the head sharded by
``fully_shard`` (untied, and tied to the input embedding) equal the single-process values on all
the ranks' data: the weight is gathered in its own dtype and its gradient reduce-scattered (averaged)
into the shard.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from _ranks import free_port, run_ranks

WORLD, N, H, V = 2, 6, 8, 40


class Tied(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(V, H)
        self.proj = torch.nn.Linear(H, H)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.proj(self.embed(ids)))


def _data(rank: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + rank)
    return (torch.randn(N, H, generator=g, dtype=torch.float64), torch.randint(0, V, (N,), generator=g),
            torch.randint(0, V, (N,), generator=g))


def _models() -> tuple[torch.nn.Linear, Tied]:
    torch.manual_seed(0)
    return torch.nn.Linear(H, V, bias=False).double(), Tied().double()


def _losses(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    from lit_memopt.ops import linear_cross_entropy, linear_entropy, linear_logprobs

    # The cross-entropy term makes its gradients in the forward (ops/_forward_grads.py): its weight gradient too
    # must reach the shard through the gather's reduce-scatter.
    return (linear_logprobs(hidden, weight, targets, chunk_size=(4, 16)).mean() + 0.5 * linear_entropy(hidden, weight, chunk_size=(4, 16)).mean()
            + 0.3 * linear_cross_entropy(hidden, weight, targets, z_loss=1e-2, chunk_size=(4, 16)))


def _reference() -> dict[str, torch.Tensor]:
    """Single process, all ranks' data, plain tensors."""
    head, tied = _models()
    hidden = torch.cat([_data(r)[0] for r in range(WORLD)]).requires_grad_()
    ids = torch.cat([_data(r)[1] for r in range(WORLD)])
    targets = torch.cat([_data(r)[2] for r in range(WORLD)])
    untied_loss = _losses(hidden, head.weight, targets)
    untied_loss.backward()
    tied_loss = _losses(tied(ids), tied.embed.weight, targets)
    tied_loss.backward()
    out = {"untied/loss": untied_loss.detach(), "tied/loss": tied_loss.detach(), "untied/hidden": hidden.grad,
           "untied/weight": head.weight.grad}
    out.update({f"tied/{n}": p.grad for n, p in tied.named_parameters()})
    return out


def _worker(rank: int, port: int, out_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(WORLD))
    torch.set_num_threads(1)
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    mesh = init_device_mesh("cpu", (WORLD,))
    head, tied = _models()
    fully_shard(head, mesh=mesh)  # never forwarded: its weight stays a sharded DTensor
    fully_shard(tied.embed, mesh=mesh)  # resharded after its forward: a DTensor again when the op reads it
    fully_shard(tied, mesh=mesh)
    hidden, ids, targets = _data(rank)
    hidden.requires_grad_()
    assert isinstance(head.weight, DTensor)
    untied_loss = _losses(hidden, head.weight, targets)
    untied_loss.backward()
    h = tied(ids)
    assert isinstance(tied.embed.weight, DTensor)
    tied_loss = _losses(h, tied.embed.weight, targets)
    tied_loss.backward()
    losses = torch.stack([untied_loss.detach(), tied_loss.detach()])
    dist.all_reduce(losses)
    out = {"untied/loss": losses[0] / WORLD, "tied/loss": losses[1] / WORLD, "untied/hidden": hidden.grad,
           "untied/weight": head.weight.grad.full_tensor(), "grad_is_sharded": isinstance(head.weight.grad, DTensor)}
    out.update({f"tied/{n}": p.grad.full_tensor() for n, p in tied.named_parameters()})
    torch.save(out, Path(out_dir) / f"rank{rank}.pt")
    # Neither rank tears its gloo pairs down while the other may still be finishing the last collective's
    # sends (that race aborted a CI run: "terminate called without an active exception" on both ranks).
    dist.barrier()
    dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_sharded_head_matches_single_process(tmp_path: Path) -> None:
    failure = run_ranks(_worker, (free_port(), str(tmp_path)), nprocs=WORLD, timeout_s=150)
    assert failure is None, f"the sharded-head run: {failure}"
    reference = _reference()
    for rank in range(WORLD):
        got = torch.load(tmp_path / f"rank{rank}.pt", weights_only=False)
        assert got.pop("grad_is_sharded")  # the gradient landed in the shard (a DTensor), not a full copy
        for key, value in got.items():
            want = reference[key]
            if key == "untied/hidden":  # this rank's rows; its loss is a mean over half the rows
                want = WORLD * want[rank * N : (rank + 1) * N]
            torch.testing.assert_close(value, want, rtol=1e-10, atol=1e-12, msg=f"rank {rank}: {key}")
