"""EvictionQueue on its own: lowest priority first, then least recently pushed; `oldest` peeks
exactly `count` pages across priorities; the counters and `queued` flags stay exact."""

import pytest

from kvpool.errors import CorruptedError, OutOfPagesError
from kvpool.eviction import EvictionQueue
from kvpool.records import Page


def pages_of(priority, count):
    pages = [Page(None, 0, 0, 0) for _ in range(count)]
    for page in pages:
        page.priority = priority
    return pages


def test_order_is_priority_then_age():
    queue = EvictionQueue()
    high, low = pages_of(50, 3), pages_of(10, 2)
    queue.push_all(high)
    for page in low:
        queue.push(page)
    last = pages_of(50, 1)[0]
    queue.push(last)
    assert list(queue) == low + high + [last]
    assert len(queue) == 6 and all(page.queued for page in queue)
    assert [queue.pop() for _ in range(6)] == low + high + [last]
    assert len(queue) == 0 and not any(page.queued for page in low + high + [last])
    with pytest.raises(OutOfPagesError, match="no evictable page"):
        queue.pop()
    queue.check_invariants()


@pytest.mark.parametrize("count", [0, 1, 2, 3, 4, 7, 9])
def test_oldest_returns_exactly_count_pages_across_priorities(count):
    queue = EvictionQueue()
    low, middle, high = pages_of(10, 2), pages_of(20, 2), pages_of(90, 3)
    queue.push_all(high + middle + low)
    assert queue.oldest(count) == (low + middle + high)[:count]
    assert len(queue) == 7  # peeking removes nothing
    queue.check_invariants()


def test_remove_keeps_the_priorities_and_length_exact():
    queue = EvictionQueue()
    low, high = pages_of(10, 2), pages_of(50, 2)
    queue.push_all(low + high)
    queue.remove(low[0])
    queue.remove_all([low[1], high[0]])
    assert list(queue) == [high[1]] and len(queue) == 1
    assert not low[0].queued and not low[1].queued and high[1].queued
    queue.check_invariants()
    queue.push(low[0])  # its priority's list is made again
    assert queue.pop() is low[0]
    queue.check_invariants()


def test_invariant_check_catches_a_page_in_the_wrong_list():
    queue = EvictionQueue()
    (page,) = pages_of(10, 1)
    queue.push(page)
    page.priority = 20  # changed while queued: the queue no longer finds it
    with pytest.raises(CorruptedError, match="priority 20"):
        queue.check_invariants()
