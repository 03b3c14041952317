"""Kernel and GPU tests put every tensor on tests/device.py's DEVICE: a static check of their source.

On the CPU every tensor shares one device, so a tensor that a GPU run would leave on the CPU passes there unseen
(Triton's interpreter even accepts it) and fails only on the GPU. The check reads the tests instead. In scope:
every file whose ``pytestmark`` has the ``kernels`` or ``gpu`` mark (all of tests/kernels/), and every function
marked ``gpu`` or ``kernels`` elsewhere in tests/. Its rules:

1. a torch factory call (``torch.randn``, ``torch.zeros``, ``torch.tensor``, ...) passes ``device=``, or lies inside
   the receiver of a ``.to(<device>)`` call (``.to(DEVICE)``, ``.to(DEVICE, dtype)``; ``.to(dtype)`` moves nothing)
   or of ``.tolist()`` / ``.item()`` (a host value);
2. the device comes from DEVICE: no ``"cpu"`` / ``"cuda"`` literal as a call argument, no ``.cuda()``, no
   ``torch.cuda.is_available()`` (tests/device.py's ``ON_CUDA`` and ``requires_cuda`` say that);
3. anywhere in tests/, a test that skips without CUDA is in scope (marked ``gpu``): the GPU session selects
   ``-m "kernels or gpu"``, so an unmarked CUDA test would never run.

A deliberate host tensor (a dispatch rule for a CPU tensor, a device mismatch under test) carries a
``# host: <why>`` comment on its line.
"""

from __future__ import annotations

import ast
import re
import textwrap
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent
FACTORIES = frozenset({
    "arange", "as_tensor", "empty", "empty_strided", "eye", "from_numpy", "full", "linspace", "logspace", "ones",
    "rand", "randint", "randn", "randperm", "range", "scalar_tensor", "tensor", "tril_indices", "triu_indices",
    "zeros",
})  # fmt: skip
HOST_VALUE = frozenset({"tolist", "item"})
DEVICE_LITERAL = re.compile(r"^(cpu|cuda(:\d+)?)$")
MARKS = frozenset({"gpu", "kernels"})
HOST_MARKER = re.compile(r"#.*\bhost: \S")


def _is_torch_attr(node: ast.AST, names: frozenset[str] | set[str]) -> bool:
    return (
        isinstance(node, ast.Attribute)
        and node.attr in names
        and isinstance(node.value, ast.Name)
        and node.value.id == "torch"
    )


def _names_a_dtype(node: ast.AST) -> bool:
    """``torch.float16``, ``dtype``, ``x.dtype``, ``out_dtype``: a ``.to`` argument that moves nothing."""
    if isinstance(node, ast.Attribute):
        return node.attr == "dtype" or (
            isinstance(node.value, ast.Name)
            and node.value.id == "torch"
            and not node.attr.startswith("device")
        )
    return isinstance(node, ast.Name) and node.id.endswith("dtype")


def _moves_to_a_device(call: ast.Call) -> bool:
    """A ``.to(...)`` call that names a device (or a tensor whose device it takes)."""
    if any(k.arg == "device" for k in call.keywords):
        return True
    return bool(call.args) and not _names_a_dtype(call.args[0])


def _marks(decorators: list[ast.expr]) -> set[str]:
    """The ``pytest.mark.<name>`` names among decorators (bare or called)."""
    found = set()
    for node in decorators:
        for sub in ast.walk(node):
            if (
                isinstance(sub, ast.Attribute)
                and isinstance(sub.value, ast.Attribute)
                and sub.value.attr == "mark"
            ):
                found.add(sub.attr)
    return found


def _scope(tree: ast.Module) -> list[ast.AST]:
    """The whole module when its ``pytestmark`` names ``kernels`` or ``gpu``, else its functions so marked."""
    for stmt in tree.body:
        if isinstance(stmt, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "pytestmark" for t in stmt.targets
        ):
            if _marks([stmt.value]) & MARKS:
                return [tree]
    return [
        node
        for node in ast.walk(tree)
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
        and _marks(node.decorator_list) & MARKS
    ]


def _skips_without_cuda(node: ast.AST) -> bool:
    for sub in ast.walk(node):
        if isinstance(sub, ast.Name) and sub.id == "requires_cuda":
            return True
        if isinstance(sub, ast.UnaryOp) and isinstance(sub.op, ast.Not) and isinstance(sub.operand, ast.Call):
            func = sub.operand.func  # not torch.cuda.is_available()
            if (
                isinstance(func, ast.Attribute)
                and func.attr == "is_available"
                and _is_torch_attr(func.value, {"cuda"})
            ):
                return True
    return False


def misplaced_tensors(source: str, filename: str = "<test>") -> list[str]:
    """Where ``source`` (a test module) makes a tensor that a GPU run would leave off DEVICE: one line each,
    ``file:line: what``. Empty when nothing is in scope or everything is placed."""
    tree = ast.parse(source, filename)
    lines = source.splitlines()
    parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
    found: set[tuple[int, str]] = set()

    def allowed(node: ast.AST) -> bool:
        return any(HOST_MARKER.search(lines[i - 1]) for i in range(node.lineno, node.end_lineno + 1))

    def placed(call: ast.Call) -> bool:
        if any(k.arg == "device" for k in call.keywords):
            return True
        child, parent = call, parents.get(call)
        method_chain = True  # only methods of the factory's result so far: a host value stays its own
        while parent is not None and not isinstance(parent, ast.stmt):
            if isinstance(parent, ast.Attribute) and parent.value is child:
                outer = parents.get(parent)
                is_call = isinstance(outer, ast.Call) and outer.func is parent
                if parent.attr in HOST_VALUE and is_call and method_chain:
                    return True
                if parent.attr == "to" and is_call and _moves_to_a_device(outer):
                    return True
            elif not (isinstance(parent, ast.Call) and parent.func is child):
                method_chain = False
            child, parent = parent, parents.get(parent)
        return False

    scope = _scope(tree)
    in_scope = {id(node) for root in scope for node in ast.walk(root)}
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)) and id(node) not in in_scope:
            if any(_skips_without_cuda(d) for d in node.decorator_list):
                found.add((node.lineno, f"{node.name} skips without CUDA but is not marked gpu"))
    for root in scope:
        for node in ast.walk(root):
            if not isinstance(node, ast.Call) or allowed(node):
                continue
            func = node.func
            if _is_torch_attr(func, FACTORIES) and not placed(node):
                found.add(
                    (node.lineno, f"torch.{func.attr}(...) without device= and not moved with .to(DEVICE)")
                )
            if isinstance(func, ast.Attribute) and func.attr == "cuda" and not node.args:
                found.add((node.lineno, ".cuda(): move with .to(DEVICE)"))
            if (
                isinstance(func, ast.Attribute)
                and func.attr == "is_available"
                and _is_torch_attr(func.value, {"cuda"})
            ):
                found.add(
                    (
                        node.lineno,
                        "torch.cuda.is_available(): use ON_CUDA / requires_cuda from tests/device.py",
                    )
                )
            if isinstance(func, ast.Attribute) and func.attr == "setenv":
                continue  # an environment value ("FASTPALS_KERNELS=cuda"), not a device
            for arg in [*node.args, *(k.value for k in node.keywords)]:
                if (
                    isinstance(arg, ast.Constant)
                    and isinstance(arg.value, str)
                    and DEVICE_LITERAL.match(arg.value)
                ):
                    found.add((node.lineno, f"device literal {arg.value!r}: use DEVICE from tests/device.py"))
    return [f"{filename}:{line}: {what}" for line, what in sorted(found)]


def _test_sources() -> list[Path]:
    return sorted(
        p for p in TESTS.rglob("*.py") if p.name.startswith("test_") and p != Path(__file__).resolve()
    )


def test_kernel_and_gpu_tests_place_every_tensor_on_device():
    problems = [
        problem
        for path in _test_sources()
        for problem in misplaced_tensors(path.read_text(), str(path.relative_to(TESTS.parent)))
    ]
    assert not problems, (
        "tensors a GPU run would leave off DEVICE (fix, or mark '# host: <why>'):\n" + "\n".join(problems)
    )


def test_the_check_covers_the_kernel_tests():
    covered = [p.name for p in _test_sources() if _scope(ast.parse(p.read_text()))]
    for name in (
        "test_pal_op.py",
        "test_grouped_linear.py",
        "test_gram.py",
        "test_combine.py",
    ):
        assert name in covered, name


def _module(body: str, mark: str = "pytestmark = pytest.mark.kernels") -> str:
    return f"import pytest\nimport torch\nfrom device import DEVICE\n\n{mark}\n\n" + textwrap.dedent(body)


# Each: code that passes on the CPU and fails on a GPU; the first four are this repository's earlier tests.
REJECTED = {
    "an input helper without a device (.to(dtype) moves nothing)": """
        def _weights(num_tasks, d, dtype, g):
            def rnd(*shape, scale):
                return (torch.randn(*shape, generator=g) * scale).to(dtype).requires_grad_()
            return [rnd(num_tasks, d, scale=0.1)]
        """,
    "a CPU eye added to a device tensor": """
        def test_heads_differ(flat):
            assert ((flat[:, None] - flat[None]).abs().mean(-1) + torch.eye(6)).min().item() > 0.3
        """,
    "a 'cpu' device argument": """
        def test_dropout(pal_attention_dropout_mask, p, seed):
            keep = pal_attention_dropout_mask(4, 2, 8, p, seed, "cpu")
        """,
    "a CPU tensor asking for the interpreter's dispatch": """
        def test_triton_mode_on_cpu_needs_the_interpreter(kernels):
            assert kernels.use_triton(torch.zeros(1)) is True
        """,
    "a mask built on the CPU, moved nowhere": """
        def _padded_case(batch, length):
            mask = torch.ones(batch, length, dtype=torch.long)
            return mask
        """,
    "moved in a later statement": """
        def make(g):
            x = torch.randn(3, generator=g)
            return x.to(DEVICE)
        """,
    "a local device of its own": """
        device = "cuda" if torch.cuda.is_available() else "cpu"
        """,
    ".cuda()": """
        def test_gpu(x):
            return x.cuda()
        """,
}


@pytest.mark.parametrize("code", REJECTED.values(), ids=list(REJECTED))
def test_the_check_rejects_device_mistakes(code):
    assert misplaced_tensors(_module(code)), code


def test_the_check_reads_gpu_marked_functions_only_outside_kernel_files():
    body = """
        def test_cpu_only():
            return torch.zeros(3)

        @pytest.mark.gpu
        def test_on_the_gpu():
            return torch.zeros(3)
        """
    source = _module(body, mark="")
    gpu_line = source.splitlines().index("def test_on_the_gpu():") + 2
    assert misplaced_tensors(source) == [
        f"<test>:{gpu_line}: torch.zeros(...) without device= and not moved with .to(DEVICE)"
    ]


def test_the_check_rejects_a_cuda_test_the_gpu_session_never_selects():
    body = """
        @pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
        def test_opcheck_on_cuda():
            pass
        """
    assert misplaced_tensors(_module(body, mark="")) == [
        "<test>:9: test_opcheck_on_cuda skips without CUDA but is not marked gpu"
    ]


ACCEPTED = """
    def make(g, dtype, lengths, x):
        a = torch.randn(3, 4, generator=g).to(DEVICE, dtype)
        b = (torch.randn(3, generator=g) * 0.5).to(DEVICE).requires_grad_()
        c = torch.zeros(2, device=DEVICE)
        d = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], device=DEVICE)
        e = torch.ones(2).to(device=x.device)
        f = torch.zeros(1, device="cpu")  # host: the dispatch rule for a CPU tensor
        n = torch.tensor(lengths).sum().item()
        return a, b, c, d, e, f, n, torch.empty_like(x)
    """


def test_the_check_accepts_placed_tensors_and_marked_host_tensors():
    assert misplaced_tensors(_module(ACCEPTED)) == []
