"""PageList: the eviction queues' lists, linked through the pages. Driven by random operations
next to an OrderedDict doing the same (the structure the lists replaced): the same order after
every operation, the links consistent, and a broken link caught by the invariant check."""

import random
from collections import OrderedDict

import pytest

from kvpool.errors import CorruptedError
from kvpool.eviction import EvictionQueue
from kvpool.page_list import PageList
from kvpool.records import Page


def new_pages(count):
    return [Page(None, 0, 0, 0) for _ in range(count)]


@pytest.mark.parametrize("seed", range(20))
def test_matches_an_ordered_dict_under_random_operations(seed):
    rng = random.Random(seed)
    pages = new_pages(12)
    lists = [PageList(), PageList()]
    models: list[OrderedDict] = [OrderedDict(), OrderedDict()]
    where: dict[int, int] = {}  # page index -> the list holding it
    for _ in range(400):
        index = rng.randrange(len(pages))
        page = pages[index]
        which = where.get(index)
        op = rng.randrange(5)
        if which is None:
            which = rng.randrange(2)
            if op < 3:
                lists[which].append(page)
                models[which][index] = None
            else:
                lists[which].appendleft(page)
                models[which][index] = None
                models[which].move_to_end(index, last=False)
            where[index] = which
        elif op == 0:
            lists[which].remove(page)
            del models[which][index]
            del where[index]
        elif op == 1 and models[which]:
            first = lists[which].popleft()
            gone, _ = models[which].popitem(last=False)
            assert first is pages[gone]
            del where[gone]
        else:
            lists[which].move_to_front(page)
            models[which].move_to_end(index, last=False)
        for pages_of, model in zip(lists, models, strict=True):
            assert [pages.index(p) for p in pages_of] == list(model)
            assert len(pages_of) == len(model) and pages_of.problems() == []
            taken: list[Page] = []
            count = rng.randrange(len(model) + 2)
            pages_of.take(count, taken)
            assert taken == [pages[i] for i in list(model)[:count]]
        for i, page in enumerate(pages):  # (holds: given the page is in that list or none)
            if where.get(i) != 1:
                assert lists[0].holds(page) == (where.get(i) == 0)
            if where.get(i) != 0:
                assert lists[1].holds(page) == (where.get(i) == 1)


def test_move_to_front_adds_a_page_in_no_list():
    pages_of, (a, b) = PageList(), new_pages(2)
    pages_of.append(a)
    pages_of.move_to_front(b)
    pages_of.move_to_front(b)  # (already first: stays)
    assert list(pages_of) == [b, a] and pages_of.last is a and len(pages_of) == 2


def test_a_removed_page_keeps_no_links():
    pages_of, pages = PageList(), new_pages(3)
    for page in pages:
        pages_of.append(page)
    pages_of.remove(pages[1])
    assert pages[1].before is None and pages[1].after is None
    assert pages[0].after is pages[2] and pages[2].before is pages[0]


def test_the_queue_invariant_check_sees_a_broken_link():
    queue, pages = EvictionQueue(), new_pages(3)
    queue.push_all(pages)
    queue.check_invariants()
    pages[2].before = pages[0]  # (should be pages[1])
    with pytest.raises(CorruptedError, match="before link"):
        queue.check_invariants()
    pages[2].before = pages[1]
    pages[1].after = None  # the walk ends early: two pages of three
    with pytest.raises(CorruptedError, match="links hold 2 pages"):
        queue.check_invariants()
