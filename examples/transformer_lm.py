"""A character-level transformer language model trained layer-parallel: its causal pre-norm
transformer blocks are the time steps that MGRIT solves for, spread over the MPI ranks.

    python examples/transformer_lm.py --steps 200
    mpiexec -n 2 python -m mpi4py examples/transformer_lm.py --steps 200

The text is the Python reference manual's topics (`mgrit.app.data.topics_text`, shipped
with Python). The model is `mgrit.nn.blocks.gpt`: token and position embeddings, `--blocks`
transformer blocks with dropout, a final norm and logits over the characters. Every forward
pass also takes an attention mask as a context input, `model(x, attn_mask=mask)`: the
mask goes to every block on every MGRIT level and in the adjoint, and here limits each
token to the `--window` characters before it (sliding-window attention, on top of the
blocks' own causal mask). Dropout draws are keyed: a block drops the same elements in every
MGRIT evaluation of one training step, and new ones the next step.

Each step samples a batch of windows of the training text, solves the forward pass with
MGRIT, computes the cross entropy of every next-character prediction, solves the adjoint
with MGRIT and takes an Adam step. Rank 0 prints the loss, the loss on windows of the
validation text, and at the end a sample of text from the exported serial network.
"""

import argparse

import torch
from mpi4py import MPI
from torch import nn

from mgrit.app.data import topics_text
from mgrit.core.grid import build_hierarchy
from mgrit.nn.blocks import gpt
from mgrit.nn.defaults import training_config

parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
parser.add_argument("--steps", type=int, default=200, help="training steps")
parser.add_argument("--width", type=int, default=64, help="model width")
parser.add_argument("--heads", type=int, default=4, help="attention heads")
parser.add_argument("--blocks", type=int, default=32, help="transformer blocks (layers)")
parser.add_argument("--context", type=int, default=64, help="characters per window")
parser.add_argument("--window", type=int, default=32, help="characters a token attends to "
                    "(itself included)")
parser.add_argument("--batch", type=int, default=16, help="windows per batch")
parser.add_argument("--dropout", type=float, default=0.1)
parser.add_argument("--lr", type=float, default=1e-3)
parser.add_argument("--levels", type=int, help="MGRIT levels (coarsening 4; default: 3, or "
                    "as many as the blocks allow)")
parser.add_argument("--every", type=int, default=50, help="validation loss every this many "
                    "steps (and after the last)")
parser.add_argument("--validation", type=int, default=128, help="validation windows")
parser.add_argument("--sample", type=int, default=120, help="characters to generate")
args = parser.parse_args()
torch.set_num_threads(1)
comm = MPI.COMM_WORLD


def possible_levels(blocks: int, wanted: int) -> int:
    """How many of `wanted` levels the blocks allow: each coarser level has a quarter of
    the steps of the one above, which must divide by 4 (8 blocks allow 2 levels)."""
    config = training_config("forward", wanted)
    return len(build_hierarchy(blocks, config.coarsening_list(), wanted, config.min_coarse))


# every rank checks the same arguments, so all of them stop alike
if args.blocks < comm.size:
    parser.error(f"--blocks {args.blocks}: each of the {comm.size} rank(s) needs a block; "
                 f"use at least {comm.size}")
if args.levels is None:
    args.levels = possible_levels(args.blocks, 3)
elif args.levels < 1 or possible_levels(args.blocks, args.levels) < args.levels:
    most = possible_levels(args.blocks, args.blocks)    # as many as coarsening gives
    parser.error(f"--levels {args.levels}: {args.blocks} blocks allow 1 to {most} levels "
                 "(each coarser level takes every 4th block of the one above)")


def sliding_window(tokens: int, window: int) -> torch.Tensor:
    """The attention mask of `tokens` positions: True where position i may attend to j,
    for j within the `window` positions up to i. It is combined with the causal mask of
    the blocks, so only its lower bound (i - j < window) matters."""
    i = torch.arange(tokens)
    return (i[:, None] - i[None, :]) < window


text = topics_text()
vocab = len(text.vocab)
x_val, y_val = (part[: args.validation] for part in text.windows("validation", args.context))
mask = sliding_window(args.context, args.window)

# the same seed on every rank: the same initial weights, and the same batches
torch.manual_seed(0)
spec = gpt(vocab, width=args.width, heads=args.heads, blocks=args.blocks,
           context=args.context, dropout=args.dropout)
# training's solver settings (mgrit.nn.defaults): F-relaxation on the fine level, FCF below,
# two forward cycles and one adjoint cycle per step
model = spec.layer_parallel(forward=training_config("forward", args.levels),
                            backward=training_config("backward", args.levels), comm=comm)
optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
batches = torch.Generator().manual_seed(1)


def next_token_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Cross entropy of every position's prediction of the next character."""
    return nn.functional.cross_entropy(logits.reshape(-1, vocab), targets.reshape(-1))


@torch.no_grad()
def validation_loss() -> float:
    model.eval()
    total = 0.0
    for start in range(0, len(x_val), 64):
        x, y = x_val[start: start + 64], y_val[start: start + 64]
        total += float(next_token_loss(model(x, attn_mask=mask), y)) * len(x)
    model.train()
    return total / len(x_val)


model.train()
for step in range(1, args.steps + 1):
    x, y = text.sample(args.batch, args.context, batches)
    optimizer.zero_grad()
    loss = next_token_loss(model(x, attn_mask=mask), y)    # the forward MGRIT solve
    loss.backward()                                         # the adjoint MGRIT solve
    optimizer.step()
    line = f"step {step}: loss {loss.item():.4f}"
    # on every rank, printed on rank 0: each evaluation is an MGRIT solve over all ranks
    if step % args.every == 0 or step == args.steps:
        line += f", validation loss {validation_loss():.4f}"
    if comm.rank == 0:
        print(line, flush=True)

# the plain network (rank 0; None elsewhere) generates text one character at a time: each
# new character would otherwise be a whole MGRIT solve
plain = model.to_serial()
if comm.rank == 0:
    plain.eval()
    ids = text.validation[: args.context // 2].tolist()
    prompt = len(ids)
    draw = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for _ in range(args.sample):
            window = torch.tensor(ids[-args.context:])[None]
            logits = plain(window, attn_mask=sliding_window(window.shape[1], args.window))
            probabilities = torch.softmax(logits[0, -1] / 0.8, dim=-1)   # temperature 0.8
            ids.append(int(torch.multinomial(probabilities, 1, generator=draw)))
    print(f"sample after {text.decode(ids[:prompt])!r}: {text.decode(ids[prompt:])!r}")
