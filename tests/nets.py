"""Small residual networks built twice: layer-parallel and as the equivalent plain network."""

import torch
from torch import nn

import mgrit

WIDTH, CLASSES = 8, 3


def dense_parts():
    opening = nn.Linear(5, WIDTH)
    closing = nn.Linear(WIDTH, CLASSES)
    return opening, closing, lambda: nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh())


def conv_parts():
    opening = nn.Conv2d(1, 3, 3, padding=1)
    closing = nn.Sequential(nn.Flatten(), nn.Linear(3 * 6 * 6, CLASSES))
    return opening, closing, lambda: nn.Sequential(nn.Conv2d(3, 3, 3, padding=1), nn.ReLU(),
                                                   nn.Conv2d(3, 3, 3, padding=1), nn.ReLU())


def gelu_parts():
    """A step module the hand-written kernels do not cover: it runs through torch.func."""
    opening = nn.Linear(5, WIDTH)
    closing = nn.Linear(WIDTH, CLASSES)
    return opening, closing, lambda: nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.GELU())


PARTS = {"dense": dense_parts, "conv": conv_parts, "gelu": gelu_parts}


def data(kind: str, batch: int, seed: int = 5):
    gen = torch.Generator().manual_seed(seed)
    shape = (batch, 1, 6, 6) if kind == "conv" else (batch, 5)
    x = torch.randn(shape, generator=gen, dtype=torch.float64)
    y = torch.randint(0, CLASSES, (batch,), generator=gen)
    return x, y


def build(kind: str, num_steps: int, forward=None, backward=None, comm=None, data_comm=None,
          seed: int = 1, kernels: str | None = None, inference=None):
    """(layer-parallel model, plain serial network) with identical initial weights; the
    model computes with `kernels` and solves evaluation's passes with `inference`
    (`LayerParallel`'s arguments)."""
    torch.manual_seed(seed)
    opening, closing, step = PARTS[kind]()
    model = mgrit.LayerParallel(step, num_steps, 1.0, forward=forward, backward=backward,
                                comm=comm, opening=opening, closing=closing, data_comm=data_comm,
                                kernels=kernels, inference=inference)
    torch.manual_seed(seed)
    opening, closing, step = PARTS[kind]()
    serial = mgrit.serial_resnet(step, num_steps, 1.0, opening, closing)
    return model.double(), serial.double()


def owned_pairs(model, serial, grad: bool = False):
    """(layer-parallel, serial) tensors, or their gradients, for every parameter this rank
    holds: its layers and the replicated opening and closing."""
    def pick(t):
        return t.grad if grad else t.detach()

    lo, hi = model.layer_range
    pairs = []
    for name in model.layers.names:
        stacked = pick(model.layers.params[name.replace(".", "__")])
        for n in range(lo, hi + 1):
            pairs.append((stacked[n - lo], pick(serial[n + 1].f.get_parameter(name))))
    for mine, ref in ((model.opening, serial[0]), (model.closing, serial[-1])):
        pairs += [(pick(a), pick(b)) for a, b in zip(mine.parameters(), ref.parameters())]
    return pairs


def relative(pairs) -> float:
    num = den = 0.0
    for a, b in pairs:
        num += float((a - b).pow(2).sum())
        den += float(b.pow(2).sum())
    return (num / den) ** 0.5 if den else num ** 0.5


def cosine(pairs) -> float:
    dot = na = nb = 0.0
    for a, b in pairs:
        dot += float((a * b).sum())
        na += float(a.pow(2).sum())
        nb += float(b.pow(2).sum())
    return dot / (na * nb) ** 0.5


def inexact_config(levels: int, cycles: int, warm: bool | str = False):
    """Training's inexact solves at `levels` levels (coarsening 2, F then FCF), from a
    zero start, a warm one (`warm` True) or a nested one (`warm` "nested")."""
    relax = ("F",) + ("FCF",) * (levels - 2) if levels > 1 else "F"
    guess = "nested" if warm == "nested" else "warm" if warm else "zero"
    return mgrit.Config(levels=levels, coarsening=2, relax=relax, tol=0.0, max_iter=cycles,
                        min_coarse=1, initial_guess=guess)


# (kind, layers, levels, start (False: zero, True: warm, "nested": nested with no cycle),
# training steps): uneven blocks on 2-4 ranks
INEXACT_CASES = [("dense", 13, 2, False, 1), ("dense", 13, 3, False, 1),
                 ("dense", 13, 4, False, 1), ("conv", 9, 2, False, 1),
                 ("conv", 9, 3, False, 1), ("dense", 13, 3, True, 3),
                 ("dense", 13, 3, "nested", 2), ("conv", 9, 2, "nested", 1)]


def inexact_training(kind: str, num_steps: int, levels: int, warm: bool, steps: int,
                     comm=None, data_comm=None) -> dict:
    """Train with 2 forward / 1 backward cycles (no cycle from a nested start) (SGD,
    `steps` steps on one batch of 8, split between data-parallel replicas if any); return
    the last step's output and input gradient (this replica's part) and, per owned layer,
    its parameter gradients and parameters after training, as nested lists of floats."""
    cycles = (0, 0) if warm == "nested" else (2, 1)
    model, _ = build(kind, num_steps, inexact_config(levels, cycles[0], warm),
                     inexact_config(levels, cycles[1], warm), comm=comm, data_comm=data_comm)
    x, y = data(kind, 8)
    if data_comm is not None:
        part = 8 // data_comm.Get_size()
        rows = slice(part * data_comm.Get_rank(), part * (data_comm.Get_rank() + 1))
        x, y = x[rows], y[rows]
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(steps):
        opt.zero_grad()
        xa = x.clone().requires_grad_()
        out = model(xa)
        # the mean over the replica's part: LayerParallel averages the replicas' gradients,
        # which gives the full batch's mean
        nn.functional.cross_entropy(out, y).backward()
        opt.step()
    lo, hi = model.layer_range
    layers = {}
    for n in range(lo, hi + 1):
        layers[n] = {name: {"grad": model.layers.params[name.replace(".", "__")].grad[n - lo]
                            .tolist(),
                            "value": model.layers.params[name.replace(".", "__")][n - lo]
                            .detach().tolist()}
                     for name in model.layers.names}
    return {"output": out.detach().tolist(), "input_grad": xa.grad.tolist(),
            "layers": layers}


def float32_errors(kind: str, num_steps: int, config, comm=None) -> dict:
    """Relative errors against float64 serial autograd of (a) float32 serial autograd and
    (b) the float32 layer-parallel network, over the same tensors (this rank's layers, the
    opening and closing; the input gradient; the output): (a) is the network's own float32
    round-off, the yardstick for (b)."""
    model, exact = build(kind, num_steps, config, config, comm=comm)
    _, serial = build(kind, num_steps, config, config)
    model, serial = model.float(), serial.float()
    x, y = data(kind, 4)
    results = {}
    inputs = {}
    for label, net, xx in (("exact", exact, x), ("serial", serial, x.float()),
                           ("lp", model, x.float())):
        xx = xx.clone().requires_grad_()
        out = net(xx)
        nn.functional.cross_entropy(out, y).backward()
        inputs[label] = (out.detach().double(), xx.grad.double())
    lo, hi = model.layer_range
    serial_pairs = [(a.grad.double(), b.grad)
                    for n in range(lo, hi + 1)
                    for a, b in zip(serial[n + 1].parameters(), exact[n + 1].parameters())]
    serial_pairs += [(a.grad.double(), b.grad) for i in (0, -1)
                     for a, b in zip(serial[i].parameters(), exact[i].parameters())]
    results["serial"] = relative(serial_pairs)
    results["lp"] = relative([(a.double(), b) for a, b in owned_pairs(model, exact, grad=True)])
    for which, index in (("output", 0), ("input_grad", 1)):
        ref = inputs["exact"][index]
        for label in ("serial", "lp"):
            results[f"{which}_{label}"] = float((inputs[label][index] - ref).norm() / ref.norm())
    return results


def round_off_equal(a, b, ulps: int = 64) -> bool:
    """Whether two tensors, or two lists of floats, agree to round-off: no difference above
    `ulps` units of the dtype's epsilon times the larger magnitude in either. A captured
    step takes some products through other torch calls than the eager step (the eager
    adjoint skips all-zero rows and takes a lone non-zero one as a single product; the
    captured one computes the whole batch), and on some CPUs (AVX-512) `torch.bmm` over a
    batch and `mm` on one of its matrices round differently in the last bit."""
    a, b = torch.as_tensor(a), torch.as_tensor(b)
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if not a.is_floating_point():
        return torch.equal(a, b)
    scale = torch.maximum(a.abs().max(), b.abs().max()) if a.numel() else 0.0
    return bool((a - b).abs().max() <= ulps * torch.finfo(a.dtype).eps * scale
                ) if a.numel() else True


def loss_fn(out, y):
    """The classification loss of these networks' training steps."""
    return nn.functional.cross_entropy(out, y)


def optimizer(name: str, model):
    """SGD with momentum ("sgd"), Adam with its step counts on the device as a CUDA graph
    needs them ("device adam", capturable=True: on a CPU only under
    `emulated_graphs.step_counts_on_the_device`) or Adam (anything else): optimizers with
    and without state that depends on the step count."""
    if name == "sgd":
        return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    return torch.optim.Adam(model.parameters(), lr=0.01, capturable=name == "device adam")


def train_eagerly(model, opt, loss, pairs, before=None, after=None):
    """The losses of plain eager training steps on the (input, target) `pairs`;
    `before(k)` runs before step k and `after()` after every step, where given."""
    losses = []
    for k, (x, y) in enumerate(pairs):
        if before is not None:
            before(k)
        opt.zero_grad()
        value = loss(model(x), y)
        value.backward()
        opt.step()
        losses.append(value.item())
        if after is not None:
            after()
    return losses


class ForcedPolicy(mgrit.nn.Policy):
    """A controller policy that measures nothing and moves to `target` at the first probe
    (every `every` steps): a test's way to make the controller change the solvers."""

    def __init__(self, base, target, every: int = 2):
        super().__init__(base, lambda s: 1.0, every=every, max_every=every, warm_trials=False)
        self.target = target

    def wanted(self, error):
        return []

    def decide(self, step, error, candidates, indicator=None):
        self.last_probe, self.setting = step, self.target
        return self.target, "forced"
