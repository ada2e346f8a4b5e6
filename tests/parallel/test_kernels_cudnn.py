"""The cuDNN SDPA kernel's call forms against the real op schemas, its numerics through CPU stand-ins, and the
dense backends' refusal of rectangular causal blocks (CPU only).

The stand-ins replace ``cudnn.FORWARD``/``cudnn.BACKWARD``: they bind every call to the real op's schema
(argument count, names, keyword-only, types) and then compute attention in float64, so a wrong call form
fails loudly and a layout or lse mix-up fails numerically.
"""

from __future__ import annotations

import pytest
import torch

from cp_train.parallel.kernels import cudnn
from cp_train.parallel.kernels.contract import BackwardRows, VarlenSegments
from cp_train.parallel.kernels.flash_attn import FlashAttn2
from cp_train.parallel.kernels.select import MathKernel
from cp_train.parallel.kernels.torch_ops import TorchCpuFlash, TorchCudaFlash, TorchEfficient
from cp_train.parallel.kernels.trial import native_gqa_agrees
from tests import flash_attn_standins as standins
from tests.numerics import rel_err

MATH = MathKernel()
REAL_FORWARD = torch.ops.aten._scaled_dot_product_cudnn_attention
REAL_BACKWARD = torch.ops.aten._scaled_dot_product_cudnn_attention_backward
# None binds to a plain Tensor argument as an undefined tensor (how torch's autograd passes attn_bias, cum_seq_*)
_TYPES = {"Tensor": (torch.Tensor, type(None)), "Optional[Tensor]": (torch.Tensor, type(None)), "bool": (bool,),
          "float": (float,), "Optional[float]": (float, type(None)), "int": (int,)}


def bind(op: torch._ops.OpOverloadPacket, args: tuple, kwargs: dict) -> dict:
    """``{name: value}`` of a call of ``op`` as its schema binds it; AssertionError for a call that does not."""
    schema = op.default._schema
    positional = [a for a in schema.arguments if not a.kwarg_only]
    assert len(args) <= len(positional), f"{schema.name}: {len(args)} positional arguments, at most {len(positional)}"
    bound = {a.name: value for a, value in zip(positional, args, strict=False)}
    names = {a.name for a in schema.arguments}
    for name, value in kwargs.items():
        assert name in names and name not in bound, f"{schema.name}: unexpected or repeated argument {name!r}"
        bound[name] = value
    for a in schema.arguments:
        if a.name not in bound:
            assert a.has_default_value(), f"{schema.name}: required argument {a.name!r} missing"
            bound[a.name] = a.default_value
        assert isinstance(bound[a.name], _TYPES[str(a.type)]), f"{schema.name}: {a.name} is {type(bound[a.name])}"
    return bound


def _bshd(x: torch.Tensor) -> torch.Tensor:
    return x.transpose(1, 2)


def _like(operand: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """``value`` in ``operand``'s dtype and memory layout, as cuDNN allocates its outputs
    (``alloc_with_matching_layout`` in ``ATen/native/cudnn/MHA.cpp``: the operand's stride order, packed)."""
    order = sorted(range(operand.dim()), key=lambda d: -operand.stride(d))
    packed = torch.empty([operand.shape[d] for d in order], dtype=operand.dtype).permute(
        [order.index(d) for d in range(operand.dim())])
    return packed.copy_(value)


GQA = {"native": False}  # whether the stand-ins take fewer K/V heads (a cuDNN build with GQA) or refuse them


def _no_zero_stride(*tensors: torch.Tensor) -> bool:
    """Whether no dim of more than one element has stride 0 (cuDNN's graphs may refuse such a tensor)."""
    return all(stride or size == 1 for t in tensors for size, stride in zip(t.shape, t.stride(), strict=True))


def standin_forward(*args, **kwargs) -> tuple:
    a = bind(REAL_FORWARD, args, kwargs)
    q, k, v = (a[name] for name in ("query", "key", "value"))
    assert GQA["native"] or q.shape[1] == k.shape[1] == v.shape[1], "the dense op is given equal heads"
    assert _no_zero_stride(q, k, v), "cuDNN is given no zero stride"
    assert a["attn_bias"] is None and a["compute_log_sumexp"] and a["dropout_p"] == 0.0
    assert not a["return_debug_mask"] and a["scale"] is not None
    out, lse = MATH.forward(_bshd(q), _bshd(k), _bshd(v), a["is_causal"], a["scale"])
    lse = lse.to(torch.float64 if q.dtype == torch.float64 else torch.float32)
    seed = torch.zeros((), dtype=torch.int64)
    return _like(q, _bshd(out)), lse[..., None], None, None, q.shape[2], k.shape[2], seed, seed, None


def standin_backward(*args, **kwargs) -> tuple:
    a = bind(REAL_BACKWARD, args, kwargs)
    q, k, v = (_bshd(a[name]) for name in ("query", "key", "value"))
    assert GQA["native"] or q.shape[2] == k.shape[2] == v.shape[2], "the dense op is given equal heads"
    assert _no_zero_stride(q, k, v), "cuDNN is given no zero stride"
    assert a["logsumexp"].shape == (*a["query"].shape[:3], 1), "lse goes back as [B, H, Sq, 1]"
    assert a["attn_bias"] is None and a["cum_seq_q"] is None and a["cum_seq_k"] is None
    assert (a["max_q"], a["max_k"]) == (q.shape[1], k.shape[1]) and a["dropout_p"] == 0.0
    rows = BackwardRows(_bshd(a["grad_out"]), q, _bshd(a["out"]), a["logsumexp"][..., 0])  # the given out and lse
    dq, dk, dv = MATH.backward(rows, k, v, a["is_causal"], a["scale"])
    return _like(a["query"], _bshd(dq)), _like(a["key"], _bshd(dk)), _like(a["value"], _bshd(dv))


@pytest.fixture
def standin_ops(monkeypatch):
    monkeypatch.setattr(cudnn, "FORWARD", standin_forward)
    monkeypatch.setattr(cudnn, "BACKWARD", standin_backward)
    monkeypatch.setitem(GQA, "native", False)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-6), (torch.float64, 1e-12)])
def test_native_gqa_hands_the_kv_heads_over_as_they_are(standin_ops, dtype: torch.dtype, tol: float) -> None:
    """With ``native_gqa`` the op gets the K/V heads without the expanding copy (the stand-ins refuse unequal
    heads unless the build takes them) and the results are the expanded call's; the probe tells the two
    builds apart."""
    GQA["native"] = True
    gen = torch.Generator().manual_seed(9)
    expanded, native = cudnn.CudnnAttention(), cudnn.CudnnAttention(native_gqa=True)
    for sq, sk, causal in ((24, 24, True), (12, 24, False)):
        q, k, v, dout = _blocks(gen, sq, sk, dtype)
        out, lse = native.forward(q, k, v, causal, 0.25)
        ref_out, ref_lse = expanded.forward(q, k, v, causal, 0.25)
        assert rel_err(out, ref_out) < tol and rel_err(lse, ref_lse) < tol
        grads = native.backward(BackwardRows(dout, q, out, lse), k, v, causal, 0.25)
        refs = expanded.backward(BackwardRows(dout, q, ref_out, ref_lse), k, v, causal, 0.25)
        for got, ref in zip(grads, refs, strict=True):
            assert got.shape == ref.shape and rel_err(got, ref) < 10 * tol
    device = torch.device("cpu")
    assert native_gqa_agrees(expanded, native, device, dtype, 16)
    GQA["native"] = False  # a build that refuses fewer K/V heads
    assert not native_gqa_agrees(expanded, native, device, dtype, 16)
    with pytest.raises(AssertionError, match="equal heads"):
        native.forward(q, k, v, False, 0.25)


def _blocks(gen, sq, sk, dtype, heads=4, kv_heads=2):
    q, dout = (torch.randn(2, sq, heads, 16, generator=gen, dtype=dtype) for _ in range(2))
    k, v = (torch.randn(2, sk, kv_heads, 16, generator=gen, dtype=dtype) for _ in range(2))
    return torch.cat([q, q], dim=1)[:, ::2], k, v, dout  # q a row-sliced view, as the ring passes


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-6), (torch.float64, 1e-12)])
def test_cudnn_dense_matches_math(standin_ops, dtype: torch.dtype, tol: float) -> None:
    gen = torch.Generator().manual_seed(0)
    kernel = cudnn.CudnnAttention()
    for sq, sk, causal in ((24, 24, True), (24, 24, False), (12, 24, False), (24, 12, False)):
        q, k, v, dout = _blocks(gen, sq, sk, dtype)
        out, lse = kernel.forward(q, k, v, causal, 0.25)
        ref_out, ref_lse = MATH.forward(q, k, v, causal, 0.25)
        assert out.shape == q.shape and out.dtype == dtype and lse.shape == (2, 4, sq)
        assert rel_err(out, ref_out) < tol and rel_err(lse, ref_lse) < tol
        ring_lse = lse.transpose(1, 2).contiguous().transpose(1, 2)  # the ring's [B, n, H] buffer, viewed
        grads = kernel.backward(BackwardRows(dout, q, out, ring_lse), k, v, causal, 0.25)
        refs = MATH.backward(BackwardRows(dout, q, None, None), k, v, causal, 0.25)
        for got, ref in zip(grads, refs, strict=True):
            assert got.shape == ref.shape and got.dtype == dtype and rel_err(got, ref) < 10 * tol


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-6), (torch.float64, 1e-12)])
def test_cudnn_varlen_matches_math(standin_ops, dtype: torch.dtype, tol: float) -> None:
    gen = torch.Generator().manual_seed(5)
    kernel = cudnn.CudnnAttention()
    for causal, rows, keys in ((True, [5, 3, 8], [9, 3, 12]), (False, [4, 7], [6, 2])):
        q, dout = (torch.randn(sum(rows), 4, 16, generator=gen, dtype=dtype) for _ in range(2))
        k, v = (torch.randn(sum(keys), 2, 16, generator=gen, dtype=dtype) for _ in range(2))
        cu_q, cu_k = (torch.tensor([0, *torch.tensor(x).cumsum(0).tolist()], dtype=torch.int32) for x in (rows, keys))
        args = (VarlenSegments(cu_q, cu_k, max(rows), max(keys)), causal, 0.25)
        out, lse = kernel.varlen_forward(q, k, v, *args)
        ref_out, ref_lse = MATH.varlen_forward(q, k, v, *args)
        assert out.shape == q.shape and lse.shape == (4, sum(rows))
        assert rel_err(out, ref_out) < tol and rel_err(lse, ref_lse) < tol
        grads = kernel.varlen_backward(BackwardRows(dout, q, out, lse), k, v, *args)
        refs = MATH.varlen_backward(BackwardRows(dout, q, ref_out, ref_lse), k, v, *args)
        for got, ref in zip(grads, refs, strict=True):
            assert got.shape == ref.shape and rel_err(got, ref) < 10 * tol


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-6), (torch.float64, 1e-12)])
def test_a_one_by_one_block_is_exact_without_the_op(monkeypatch, dtype: torch.dtype, tol: float) -> None:
    """cuDNN refuses s_q = s_kv = 1 (an H200, cuDNN 9.19): such a block is computed exactly, also as one of a
    row's several blocks (its backward given the row's final out/lse)."""
    def refuse(*args, **kwargs):
        raise RuntimeError("cuDNN Frontend error: s_q = s_kv = 1 is not supported.")
    monkeypatch.setattr(cudnn, "FORWARD", refuse)
    monkeypatch.setattr(cudnn, "BACKWARD", refuse)
    gen = torch.Generator().manual_seed(3)
    q, dout = (torch.randn(2, 1, 4, 16, generator=gen, dtype=dtype) for _ in range(2))
    k, v = (torch.randn(2, 3, 2, 16, generator=gen, dtype=dtype) for _ in range(2))
    kernel = cudnn.CudnnAttention()
    for causal in (True, False):
        out, lse = kernel.forward(q, k[:, 2:], v[:, 2:], causal, 0.25)
        ref_out, ref_lse = MATH.forward(q, k[:, 2:], v[:, 2:], causal, 0.25)
        assert out.dtype == dtype and rel_err(out, ref_out) < tol and rel_err(lse, ref_lse) < tol
    row_out, row_lse = MATH.forward(q, k, v, False, 0.25)  # the row attends to 3 keys; the block is the last
    rows = BackwardRows(dout, q, row_out, row_lse)
    grads = kernel.backward(rows, k[:, 2:], v[:, 2:], True, 0.25)
    refs = MATH.backward(rows, k[:, 2:], v[:, 2:], True, 0.25)
    for got, ref in zip(grads, refs, strict=True):
        assert got.shape == ref.shape and got.dtype == dtype and rel_err(got, ref) < 10 * tol
    assert grads[0].abs().max() > 0  # not the lone key's zero dq: the row's other keys give it a gradient


@pytest.mark.parametrize("native", [False, True])
def test_one_kv_head_goes_in_packed_and_out_dout_packed(standin_ops, monkeypatch, native: bool) -> None:
    """One K/V head (MQA): expanded by a packed copy, not expand_kv's stride-0 view (the stand-ins refuse zero
    strides). The backward gets out and dout packed whatever views it is given (two samples' row slice of a head
    chunk here): PyTorch's cuDNN backward graphs assume the out/dout strides of a key's first call."""
    GQA["native"] = native
    given = []

    def recording(*args, **kwargs):
        a = bind(REAL_BACKWARD, args, kwargs)
        given.append(all(_bshd(a[name]).is_contiguous() for name in ("out", "grad_out")))
        return standin_backward(*args, **kwargs)

    monkeypatch.setattr(cudnn, "BACKWARD", recording)
    gen = torch.Generator().manual_seed(4)
    q, dout = (torch.randn(2, 24, 6, 16, generator=gen)[:, 4:16, 1:5] for _ in range(2))  # [2, 12, 4, 16] views
    k, v = (torch.randn(2, 12, 1, 16, generator=gen) for _ in range(2))
    kernel = cudnn.CudnnAttention(native_gqa=native)
    out, lse = kernel.forward(q, k, v, True, 0.25)
    ref_out, ref_lse = MATH.forward(q, k, v, True, 0.25)
    assert rel_err(out, ref_out) < 1e-6 and rel_err(lse, ref_lse) < 1e-6
    chunk = torch.cat([out, out], dim=2)[:, :, 4:]  # out as a head chunk of a wider buffer (a strided view)
    grads = kernel.backward(BackwardRows(dout, q, chunk, lse), k, v, True, 0.25)
    refs = MATH.backward(BackwardRows(dout, q, None, None), k, v, True, 0.25)
    for got, ref in zip(grads, refs, strict=True):
        assert got.shape == ref.shape and rel_err(got, ref) < 1e-5
    assert given == [True]


def test_a_three_dim_lse_is_taken_and_a_wrong_one_raises(standin_ops, monkeypatch) -> None:
    """A release that returns the lse ``[B, H, Sq]`` gives the same results; an lse of another shape raises
    (``lse[..., 0]`` would have taken a [B, H, Sq] lse's first row silently)."""
    gen = torch.Generator().manual_seed(6)
    q, k, v, _ = _blocks(gen, 12, 12, torch.float32)
    want = cudnn.CudnnAttention().forward(q, k, v, True, 0.25)
    for reshape, ok in ((lambda lse: lse[..., 0], True), (lambda lse: lse[:, :, :-1], False)):
        def forward(*args, reshape=reshape, **kwargs):
            result = standin_forward(*args, **kwargs)
            return (result[0], reshape(result[1]), *result[2:])

        monkeypatch.setattr(cudnn, "FORWARD", forward)
        if ok:
            got = cudnn.CudnnAttention().forward(q, k, v, True, 0.25)
            assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
        else:
            with pytest.raises(RuntimeError):
                cudnn.CudnnAttention().forward(q, k, v, True, 0.25)


def test_the_binding_check_catches_a_wrong_call() -> None:
    q = torch.zeros(1, 2, 4, 8)
    with pytest.raises(AssertionError, match="at most 8"):
        bind(REAL_FORWARD, (q, q, q, None, True, 0.0, False, False, 0.5), {})  # scale is keyword-only
    with pytest.raises(AssertionError, match="unexpected or repeated argument 'softmax_scale'"):
        bind(REAL_FORWARD, (q, q, q, None, True), {"softmax_scale": 0.5})
    with pytest.raises(AssertionError, match="required argument 'compute_log_sumexp' missing"):
        bind(REAL_FORWARD, (q, q, q, None), {})
    with pytest.raises(AssertionError, match="is_causal is <class 'int'>"):
        bind(REAL_FORWARD, (q, q, q, None, True, 0.0, 1), {})


@pytest.mark.parametrize("sq,sk,kv_heads", [(100, 100, 8), (100, 228, 2), (64, 32, 1)])
def test_cudnn_calls_go_through_the_real_ops(sq: int, sk: int, kv_heads: int) -> None:
    """The real ops' argument parsing and meta kernels (shapes, the [B, H, Sq, 1] lse), no GPU."""
    meta = lambda s, h: torch.empty(2, s, h, 64, dtype=torch.bfloat16, device="meta")  # noqa: E731
    q, dout, k, v = meta(sq, 8), meta(sq, 8), meta(sk, kv_heads), meta(sk, kv_heads)
    kernel = cudnn.CudnnAttention()
    out, lse = kernel.forward(q, k, v, sq == sk, 0.125)
    assert out.shape == q.shape and lse.shape == (2, 8, sq) and lse.dtype == torch.float32
    dq, dk, dv = kernel.backward(BackwardRows(dout, q, out, lse), k, v, sq == sk, 0.125)
    assert dq.shape == q.shape and dk.shape == k.shape and dv.shape == v.shape  # GQA grads summed back
    cpu = torch.zeros(1, 16, 2, 8)
    with pytest.raises(NotImplementedError, match="_scaled_dot_product_cudnn_attention_backward' with arguments"):
        kernel.backward(BackwardRows(cpu, cpu, cpu, torch.zeros(1, 2, 16)), cpu, cpu, True, 0.125)


def test_dense_backends_refuse_a_rectangular_causal_block() -> None:
    meta = lambda s: torch.empty(1, s, 2, 16, dtype=torch.bfloat16, device="meta")  # noqa: E731
    q, k = meta(8), meta(16)
    kernels = [TorchCudaFlash(), TorchEfficient(), cudnn.CudnnAttention(),
               FlashAttn2.load(standins.flash_attn_interface("2.8.3"), "2.8.3")]
    for kernel in kernels:
        with pytest.raises(ValueError, match="dense causal block must be square, got 8 query rows and 16 key rows"):
            kernel.forward(q, k, k, True, 0.25)
        with pytest.raises(ValueError, match="must be square"):
            kernel.backward(BackwardRows(q, q, q, torch.empty(1, 2, 8, device="meta")), k, k, True, 0.25)
    for kernel in kernels[:3]:  # the ops' meta kernels: non-causal rectangles pass the check
        assert kernel.forward(q, k, k, False, 0.25)[0].shape == q.shape
    cpu_q, cpu_k = torch.zeros(1, 8, 2, 16), torch.zeros(1, 16, 2, 16)
    with pytest.raises(ValueError, match="torch cpu flash: a dense causal block must be square"):
        TorchCpuFlash().forward(cpu_q, cpu_k, cpu_k, True, 0.25)
    out, lse = TorchCpuFlash().forward(cpu_q, cpu_k, cpu_k, False, 0.25)  # non-causal rectangles are fine
    assert out.shape == cpu_q.shape and lse.shape == (1, 2, 8)
