"""Paged pools in either layout (runtime/kv_layout.py): AttnFuse's "NHD" (pages, page_size, Hkv, D) and
FlashInfer's and vLLM's "HND" (pages, Hkv, page_size, D), named by ``kv_layout``; a shape both layouts would
read with a head count dividing Hq is refused unless the call names one, and so is a named layout the
shape contradicts. The interpreter bounds-checks every load, so a call that returns read nothing outside
its tensors."""

import json

import pytest
import torch

import attnfuse as af
from attnfuse import call_spec
from attnfuse.runtime.inputs import check_cache
from attnfuse.runtime.launch import run_attention

P, D, NQ = 7, 16, 2  # pool pages, head dim, queries


@af.attention
def llama(q, k, v):
    return af.softmax(af.causal(af.rope(q, k))) @ v


def _pools(layout, Hkv, page, dtype=torch.float32, transposed=False):
    """k, v pools of P pages in ``layout``; ``transposed``: in the other layout's memory order (a strided view)."""
    shape = (P, page, Hkv, D) if layout == "NHD" else (P, Hkv, page, D)
    if transposed:
        return tuple(torch.randn(shape[0], shape[2], shape[1], D, dtype=dtype).transpose(1, 2) for _ in range(2))
    return tuple(torch.randn(shape, dtype=dtype) for _ in range(2))


def _held(pool, table, layout):
    """The contiguous cache (B, Hkv, max_pages * page_size, D) the table's pages hold, gathered by hand."""
    by_head = pool.transpose(1, 2) if layout == "NHD" else pool  # (P, Hkv, page_size, D)
    return torch.stack([torch.cat([by_head[p] for p in row.tolist()], dim=1) for row in table]).contiguous()


def _table_and_lens(page):
    """Sequence 0 fills its 3 pages, sequence 1 ends inside its second; pages shuffled."""
    table = torch.randperm(P)[:6].view(2, 3).to(torch.int32)
    return table, torch.tensor([3 * page, page + max(1, page // 2)], dtype=torch.int32)


# (Hq, Hkv, page_size): the shape (both layouts fit Hq=32), MQA and GQA shapes both fit, square pages of
# heads, and shapes only one layout fits.
SHAPES = [(32, 8, 16), (8, 1, 4), (4, 2, 2), (4, 4, 2), (6, 3, 16), (4, 2, 16)]


@pytest.mark.parametrize("transposed", [False, True], ids=["contiguous_pool", "strided_pool"])
@pytest.mark.parametrize("split_kv", [True, False], ids=["split_kv", "forward"])
@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("Hq, Hkv, page", SHAPES, ids=lambda x: str(x))
def test_a_named_layout_reads_the_pools_as_the_cache_they_hold(Hq, Hkv, page, layout, split_kv, transposed):
    """Against the float64 reference of the same cache made contiguous by hand, on both kernel paths."""
    pool_k, pool_v = _pools(layout, Hkv, page, transposed=transposed)
    table, lens = _table_and_lens(page)
    q = torch.randn(2, Hq, NQ, D)
    k, v = _held(pool_k, table, layout), _held(pool_v, table, layout)
    want = llama.reference(q, k, v, kv_lens=lens)
    out = run_attention(
        llama.graph(), q, pool_k, pool_v, kv_lens=lens, block_table=table, kv_layout=layout, split_kv=split_kv
    )
    torch.testing.assert_close(out.double(), want, atol=2e-5, rtol=0)
    torch.testing.assert_close(llama(q, pool_k, pool_v, kv_lens=lens, block_table=table, kv_layout=layout), out)
    paged_reference = llama.reference(q, pool_k, pool_v, kv_lens=lens, block_table=table, kv_layout=layout)
    torch.testing.assert_close(paged_reference, want, atol=1e-12, rtol=0)


@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_the_kernels_read_the_pools_themselves(layout):
    """No copy: the kernels' (pages, Hkv, page_size, D) view is the caller's pool, by strides."""
    pool_k, pool_v = _pools(layout, 2, 8, transposed=True)
    table, lens = _table_and_lens(8)
    kv = check_cache(torch.randn(2, 8, NQ, D), pool_k, pool_v, lens, table, layout)
    for view, pool in ((kv.k, pool_k), (kv.v, pool_v)):
        assert view.data_ptr() == pool.data_ptr() and view.shape == (P, 2, 8, D)
        assert view.stride() == (pool.stride() if layout == "HND" else pool.permute(0, 2, 1, 3).stride())


def _calls(q, pool_k, pool_v, lens, table, **options):
    """Every way a call reads paged pools: eager (both paths), run_attention, the reference, the source."""
    return {
        "eager": lambda: llama(q, pool_k, pool_v, kv_lens=lens, block_table=table, **options),
        "forward": lambda: run_attention(
            llama.graph(), q, pool_k, pool_v, kv_lens=lens, block_table=table, split_kv=False, **options
        ),
        "reference": lambda: llama.reference(q, pool_k, pool_v, kv_lens=lens, block_table=table, **options),
        "source": lambda: llama.source(q, pool_k, pool_v, kv_lens=lens, block_table=table, kernel="decode", **options),
    }


# (Hq, pool dims 1 and 2): both readings give a head count dividing Hq.
AMBIGUOUS = [(32, 8, 16), (32, 16, 8), (4, 2, 2), (8, 1, 4), (8, 4, 1), (4, 4, 4), (2, 1, 2)]


@pytest.mark.parametrize("how", ["eager", "forward", "reference", "source"])
@pytest.mark.parametrize("Hq, a, b", AMBIGUOUS, ids=lambda x: str(x))
def test_an_ambiguous_pool_needs_a_named_layout(Hq, a, b, how):
    pool_k, pool_v = (torch.randn(P, a, b, D) for _ in range(2))
    table, lens = _table_and_lens(min(a, b))
    q = torch.randn(2, Hq, 1, D)
    with pytest.raises(
        af.InputError,
        match=(
            rf"^paged pools of shape \({P}, {a}, {b}, {D}\) read two ways for Hq={Hq} query heads: as "
            rf"kv_layout='NHD' \(num_pages, page_size, Hkv, D\), page_size {a} and Hkv {b}, or as kv_layout='HND' "
            rf"\(num_pages, Hkv, page_size, D\), page_size {b} and Hkv {a}\. Name the pools' layout: "
            rf"kv_layout='NHD' \(AttnFuse's\) or kv_layout='HND' \(FlashInfer's and vLLM's\)$"
        ),
    ):
        _calls(q, pool_k, pool_v, lens, table)[how]()
    for layout in ("NHD", "HND"):  # named, either reading is taken
        _calls(q, pool_k, pool_v, lens, table, kv_layout=layout)[how]()


def test_one_row_of_one_head_reads_the_same_either_way():
    """Pools (pages, 1, 1, D): both layouts read the same memory, so no layout need be named."""
    pool_k, pool_v = (torch.randn(P, 1, 1, D) for _ in range(2))
    table = torch.randperm(P)[:6].view(2, 3).to(torch.int32)
    lens = torch.tensor([3, 2], dtype=torch.int32)
    q = torch.randn(2, 4, 1, D)
    out = llama(q, pool_k, pool_v, kv_lens=lens, block_table=table)
    want = llama.reference(q, _held(pool_k, table, "NHD"), _held(pool_v, table, "NHD"), kv_lens=lens)
    torch.testing.assert_close(out.double(), want, atol=2e-5, rtol=0)
    torch.testing.assert_close(llama(q, pool_k, pool_v, kv_lens=lens, block_table=table, kv_layout="HND"), out)


# (Hq, pool dims 1 and 2, the layout that fits): exactly one reading gives a head count dividing Hq.
ONE_WAY = [(8, 8, 16, "HND"), (8, 16, 8, "NHD"), (6, 3, 16, "HND"), (6, 16, 3, "NHD"), (4, 1, 8, "HND")]


@pytest.mark.parametrize("how", ["eager", "forward", "reference", "source"])
@pytest.mark.parametrize("Hq, a, b, fits", ONE_WAY, ids=lambda x: str(x))
def test_a_layout_the_shape_contradicts_is_refused_naming_the_one_that_fits(Hq, a, b, fits, how):
    pool_k, pool_v = (torch.randn(P, a, b, D) for _ in range(2))
    q = torch.randn(2, Hq, 1, D)
    other = "HND" if fits == "NHD" else "NHD"
    wrong_heads = b if other == "NHD" else a
    page, heads = (a, b) if fits == "NHD" else (b, a)
    table, lens = _table_and_lens(page)
    shape = r"\(num_pages, page_size, Hkv, D\)" if fits == "NHD" else r"\(num_pages, Hkv, page_size, D\)"
    for named, when in ((other, ""), (None, r" \(when none is named\)")):
        if named is None and fits == "NHD":
            continue  # the default reading fits: no error
        with pytest.raises(
            af.InputError,
            match=(
                rf"^paged pools of shape \({P}, {a}, {b}, {D}\) in kv_layout='{other}'{when} have Hkv={wrong_heads} "
                rf"heads, which Hq={Hq} query heads is not a multiple of; as kv_layout='{fits}' {shape}, page_size "
                rf"{page} and Hkv {heads} would fit: pass kv_layout='{fits}' if that is the pools' layout$"
            ),
        ):
            _calls(q, pool_k, pool_v, lens, table, **({} if named is None else {"kv_layout": named}))[how]()
    _calls(q, pool_k, pool_v, lens, table, kv_layout=fits)[how]()


@pytest.mark.parametrize("value", ["nhd", "NDH", "", 1, ["HND"], torch.tensor(0)], ids=repr)
def test_kv_layout_must_be_one_of_the_layouts(value):
    pool_k, pool_v = _pools("NHD", 2, 16)
    table, lens = _table_and_lens(16)
    q = torch.randn(2, 4, 1, D)
    for how, call in _calls(q, pool_k, pool_v, lens, table, kv_layout=value).items():
        with pytest.raises(
            af.InputError,
            match=r"^kv_layout must be 'NHD' \(pools \(num_pages, page_size, Hkv, "
            r"D\), AttnFuse's\), 'HND' \(pools \(num_pages, Hkv, page_size, D\), "
            r"FlashInfer's and vLLM's\) or None \(read as 'NHD'\), got ",
        ):
            call()


@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_a_contiguous_cache_takes_no_kv_layout(layout):
    q, k, v = torch.randn(2, 4, 1, D), torch.randn(2, 2, 24, D), torch.randn(2, 2, 24, D)
    lens = torch.tensor([24, 9], dtype=torch.int32)
    with pytest.raises(
        af.InputError,
        match=rf"^kv_layout='{layout}' describes a paged cache's pools \(a call with "
        rf"block_table\); a contiguous cache is \(B, Hkv, Nk, D\)",
    ):
        llama(q, k, v, kv_lens=lens, kv_layout=layout)
    with pytest.raises(af.InputError, match=r"describes a paged cache's pools"):
        llama.reference(q, k, v, kv_lens=lens, kv_layout=layout)


@pytest.mark.parametrize("split_kv", [True, False], ids=["split_kv", "forward"])
def test_the_capacity_of_hnd_pools_is_their_pages_of_page_size_keys(split_kv):
    """HND pools (P, 2, 16, D) and 3 pages per sequence hold 48 keys (read as NHD they would hold 6): 48 is
    accepted, 49 refused; unvalidated, 49 and past int32 count as 48, with nothing read past the pages."""
    pool_k, pool_v = _pools("HND", 2, 16, dtype=torch.float64)
    table, _ = _table_and_lens(16)
    q = torch.randn(2, 4, NQ, D, dtype=torch.float64)
    k, v = _held(pool_k, table, "HND"), _held(pool_v, table, "HND")

    def call(lens, **options):
        return run_attention(
            llama.graph(),
            q,
            pool_k,
            pool_v,
            kv_lens=lens,
            block_table=table,
            kv_layout="HND",
            split_kv=split_kv,
            **options,
        )

    full = torch.tensor([48, 48], dtype=torch.int32)
    torch.testing.assert_close(call(full), llama.reference(q, k, v, kv_lens=full), atol=1e-10, rtol=0)
    over = torch.tensor([48, 49], dtype=torch.int64)
    message = (
        r"^kv_lens\[1\] = 49: a sequence's key count must be in \[0, 48\], the capacity of its paged "
        r"cache: block_table's 3 pages x page_size 16$"
    )
    with pytest.raises(af.InputError, match=message):
        call(over)
    with pytest.raises(af.InputError, match=message):
        llama.reference(q, pool_k, pool_v, kv_lens=over, block_table=table, kv_layout="HND")
    for hostile in (over, torch.tensor([2**32 + 5, 49], dtype=torch.int64)):
        torch.testing.assert_close(
            call(hostile, validate=False), llama.reference(q, k, v, kv_lens=full), atol=1e-10, rtol=0
        )


def test_kv_layout_under_torch_compile():
    """The op's CallSpec carries the layout: a compiled call reads HND pools as an eager one, refuses an
    ambiguous shape unnamed (from the op's fake kernel, while compiling), and a key made before the field
    existed reads as naming none."""
    pool_k, pool_v = _pools("HND", 8, 16)
    table, lens = _table_and_lens(16)
    q = torch.randn(2, 32, 1, D)
    compiled = torch.compile(
        lambda q, k, v, lens, table: llama(q, k, v, kv_lens=lens, block_table=table, kv_layout="HND"),
        backend="aot_eager",
        fullgraph=True,
    )
    want = llama.reference(q, _held(pool_k, table, "HND"), _held(pool_v, table, "HND"), kv_lens=lens)
    torch.testing.assert_close(compiled(q, pool_k, pool_v, lens, table).double(), want, atol=2e-5, rtol=0)
    with pytest.raises(
        torch._dynamo.exc.TorchRuntimeError,
        match=r"got InputError\(\"paged pools of shape "
        r"\(7, 8, 16, 16\) read two ways for Hq=32",
    ):
        torch.compile(
            lambda q, k, v, lens, table: llama(q, k, v, kv_lens=lens, block_table=table), backend="aot_eager"
        )(q, pool_k, pool_v, lens, table)

    spec = call_spec.CallSpec(graph=llama.graph(), inputs=(), save_lse=False, grad=False, grads=(), kv_layout="HND")
    assert call_spec.spec_of(json.dumps(spec.to_data())).kv_layout == "HND"
    old = {name: value for name, value in spec.to_data().items() if name != "kv_layout"}
    assert call_spec.spec_of(json.dumps(old)).kv_layout is None
    with pytest.raises(af.InputError, match="key must be the data of a CallSpec"):
        call_spec.spec_of(json.dumps({**spec.to_data(), "kv_layout": "nhd"}))


def test_kv_layout_is_reserved_for_the_call():
    with pytest.raises(af.ProgramError, match=r"argument name\(s\) \['kv_layout'\] are reserved"):

        @af.attention
        def laid_out(q, k, v, kv_layout):
            return af.softmax(af.scaled_dot_product(q, k)) @ v
