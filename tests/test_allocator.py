"""PageAllocator, page_slots and ReqToTokenTable."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dsakv.memory import OutOfPages, PageAllocator, PageError, ReqToTokenTable, page_slots


def test_alloc_free_counts():
    a = PageAllocator(8, 64)
    p = a.alloc(3)
    assert len(set(p)) == 3 and a.num_used_pages == 3 and a.num_free_pages == 5
    assert a.alloc(0) == []
    a.free(p)
    assert a.num_free_pages == 8
    a.check()


def test_out_of_pages_allocates_nothing():
    a = PageAllocator(4, 16)
    a.alloc(3)
    with pytest.raises(OutOfPages, match="need 2 pages but only 1 of 4"):
        a.alloc(2)
    assert a.num_free_pages == 1
    assert isinstance(OutOfPages("x"), RuntimeError)
    a.check()


def test_double_free_and_foreign_page_are_clear_errors():
    a = PageAllocator(4, 16)
    p = a.alloc(2)
    a.free(p[:1])
    with pytest.raises(PageError, match=f"double free of page {p[0]}"):
        a.free(p[:1])
    with pytest.raises(PageError, match="page 9 was never handed out"):
        a.free([9])
    with pytest.raises(PageError, match="never handed out"):
        a.free([-1])
    with pytest.raises(PageError, match="double free"):  # duplicate within one call
        a.free([p[1], p[1]])
    assert a._in_use[p[1]]  # the failed call freed nothing
    assert issubclass(PageError, ValueError)
    a.check()


def test_non_integer_counts_and_pages_are_type_errors_that_change_nothing():
    a = PageAllocator(4, 16)
    p = a.alloc(1)
    for bad in (True, 1.0, "1"):
        with pytest.raises(TypeError, match="number of pages must be an int"):
            a.alloc(bad)
    for bad in ("0", 0.5, True):  # int() of each names a page: "0" would free page 0
        with pytest.raises(TypeError, match="pages must be ints"):
            a.free([bad])
    assert a.num_used_pages == 1
    a.free(p)
    a.check()
    for args in ((True, 16), (4, 16.0)):
        with pytest.raises(TypeError, match="must be ints"):
            PageAllocator(*args)


def test_check_detects_corruption():
    a = PageAllocator(4, 16)
    a.alloc(1)
    a._free.append(a._free[0])
    with pytest.raises(AssertionError):
        a.check()


def test_page_slots():
    assert page_slots([2, 0], 4).tolist() == [8, 9, 10, 11, 0, 1, 2, 3]
    assert page_slots(torch.tensor([1]), 3).dtype == torch.long
    assert page_slots([], 4).numel() == 0
    with pytest.raises(ValueError, match="page -1 is negative"):
        page_slots([2, -1], 4)
    for bad in ([1.0], [True]):
        with pytest.raises(TypeError, match="pages must be integers"):
            page_slots(bad, 4)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(0, 5)), max_size=40))
def test_allocator_against_model(ops):
    """Random alloc/free sequences: pages never handed out twice, counts always add up."""
    a, held = PageAllocator(12, 8), []
    for is_alloc, n in ops:
        if is_alloc:
            free_before = a.num_free_pages
            if n > free_before:
                with pytest.raises(OutOfPages):
                    a.alloc(n)
                assert a.num_free_pages == free_before
            else:
                got = a.alloc(n)
                assert not set(got) & {p for b in held for p in b}
                held.append(got)
        elif held:
            a.free(held.pop(n % len(held)))
        a.check()
        assert a.num_used_pages == sum(map(len, held))


def test_req_to_token_table():
    t = ReqToTokenTable()
    t.extend(7, torch.tensor([4, 5, 6]))
    t.extend(7, [20])
    t.extend(8, [1])
    assert 7 in t and len(t) == 2
    assert t.get(7).tolist() == [4, 5, 6, 20]
    assert t.get(7, 2).tolist() == [4, 5] and t.get(7).dtype == torch.long
    t.release(7)
    assert 7 not in t and len(t) == 1
    with pytest.raises(KeyError, match="unknown request 7"):
        t.get(7)
    with pytest.raises(KeyError, match="unknown request 7"):
        t.release(7)
    with pytest.raises(IndexError, match="has 1 positions"):
        t.get(8, 2)
