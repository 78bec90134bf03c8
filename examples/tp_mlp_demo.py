"""Megatron 1D tensor parallelism in 30 lines: a column → row MLP on T local ranks.

    torchrun --nproc-per-node 2 examples/tp_mlp_demo.py            # gloo on CPU, nccl on GPUs
    torchrun --nproc-per-node 4 examples/tp_mlp_demo.py --sequence-parallel

Each rank holds 1/T of both weights, checks its output and input gradient against the
same MLP computed on one device from the same seed, and rank 0 prints what the
communication ledger recorded next to the formula of gridshard.tensor.tp1d.theory.
"""
import argparse

import torch
import torch.distributed as dist
import torch.nn.functional as F

import gridshard
from gridshard.tensor.tp1d.linear import ColumnParallelLinear, RowParallelLinear
from gridshard.tensor.tp1d.theory import column_row_comm

p = argparse.ArgumentParser()
p.add_argument("--hidden", type=int, default=256)
p.add_argument("--batch", type=int, default=4)
p.add_argument("--seq", type=int, default=64)
p.add_argument("--sequence-parallel", action="store_true")
args = p.parse_args()

gridshard.init_distributed()
T = dist.get_world_size()
mesh = gridshard.build_mesh(tensor=T)
h, sp = args.hidden, args.sequence_parallel
device = gridshard.device.rank_device()

torch.manual_seed(0)                              # same seed → same global weights at any T
fc1 = ColumnParallelLinear(h, 4 * h, mesh, sequence_parallel=sp, device=device)
fc2 = RowParallelLinear(4 * h, h, mesh, sequence_parallel=sp, device=device)
torch.manual_seed(0)                              # the single-device reference, same draws
w1, w2 = torch.randn(4 * h, h) * 0.02, torch.randn(h, 4 * h) * 0.02

x = torch.randn(args.batch, args.seq, h, generator=torch.Generator().manual_seed(1))
x_ref = x.clone().requires_grad_()
y_ref = F.linear(F.gelu(F.linear(x_ref, w1)), w2)
y_ref.sum().backward()

x_local = x.chunk(T, dim=1)[mesh.tensor.rank] if sp else x   # SP: each rank feeds its sequence block
x_local = x_local.to(device).requires_grad_()
gridshard.LEDGER.reset()
y = fc2(F.gelu(fc1(x_local)))
y.sum().backward()

expect_y = y_ref.chunk(T, dim=1)[mesh.tensor.rank] if sp else y_ref
expect_dx = x_ref.grad.chunk(T, dim=1)[mesh.tensor.rank] if sp else x_ref.grad
err_y = ((y.cpu() - expect_y).norm() / expect_y.norm()).item()
err_dx = ((x_local.grad.cpu() - expect_dx).norm() / expect_dx.norm()).item()
theory = column_row_comm(args.batch, args.seq, h, T, sp, row_bias=True)
if dist.get_rank() == 0:
    print(f"T={T} sequence_parallel={sp}: rel. error output {err_y:.1e}, input grad {err_dx:.1e}")
    print(gridshard.LEDGER.summary())
    print(f"theory (gridshard.tensor.tp1d.theory.column_row_comm): {theory}")
dist.barrier()
dist.destroy_process_group()
