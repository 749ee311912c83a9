"""resume.py on the wire's types, without servers: a broken stream's lines continued from another one.

The real-server tests (tests/test_resume.py, slow) kill and freeze decode servers; these check the
bookkeeping itself on ``wire.Piece``/``wire.Final`` lines: the caller gets each piece once (a piece
that straddles the break is cut), a replay that differs ends with an error naming both servers, with
nowhere to go the error is the one the stream broke with, and the moves reach the caller as
``RequestMetrics.resumed`` (``metrics.Move``), in its dict as in its type.
"""
from __future__ import annotations

import warnings
from types import SimpleNamespace

import pytest

from disaggregated_inference import resume
from disaggregated_inference.errors import UpstreamError
from disaggregated_inference.metrics import Method, Move, RequestMetrics
from disaggregated_inference.wire import Final, Piece


def _server(name: str):
    return SimpleNamespace(entry=SimpleNamespace(name=name, address=f"127.0.0.1:{name}"))


A, B, P = _server("decode-a"), _server("decode-b"), _server("prefill-a")


def _broken(*pieces, error=True):
    yield from pieces
    if error:
        raise UpstreamError("decode-a broke off its answer: ChunkedEncodingError", transport=True)


def _lines(*lines):
    yield from lines  # a generator, as _ndjson_lines is


def _continuation(new_lines, others=(A, B)):
    marked = []
    first = SimpleNamespace(decode_server=A, prefill_server=P, method=Method.KV_HANDOFF, first_piece_at=1.0, lines=None)

    def reopen():
        return SimpleNamespace(decode_server=B, prefill_server=P, method=Method.KV_HANDOFF, first_piece_at=None,
                               lines=new_lines), ["a note"]

    return resume.Continuation(first, reopen, lambda: list(others), lambda s, m, hard: marked.append(s)), marked


def test_a_broken_stream_goes_on_with_each_piece_once_and_a_straddling_piece_cut():
    again = _lines(*[Piece(text="Hel"), Piece(reasoning="hm"), Piece(text="lo wor"), Piece(text="ld"),
                  Final("length", {"completion_tokens": 4})])
    moved, marked = _continuation(again)
    got = list(moved.lines(_broken(Piece(text="Hel"), Piece(reasoning="hm"), Piece(text="lo"))))
    assert got == [Piece(text="Hel"), Piece(reasoning="hm"), Piece(text="lo"), Piece(text=" wor"), Piece(text="ld"),
                   Final("length", {"completion_tokens": 4})]
    assert marked == [A] and moved.served.decode_server is B and moved.served.first_piece_at == 1.0
    (move,) = moved.moves
    assert move["after_pieces"] == 3 and move["pieces_replayed"] == 3


def test_a_replay_that_differs_is_an_error_naming_both_servers():
    moved, _ = _continuation(_lines(*[Piece(text="Help"), Final("stop")]))
    with pytest.raises(UpstreamError, match="decode-a failed mid-answer and decode-b") as info:
        list(moved.lines(_broken(Piece(text="Hel"), Piece(text="lo"))))
    assert "text differs" in info.value.message


def test_with_nowhere_to_go_the_error_is_the_one_the_stream_broke_with():
    moved, marked = _continuation(_lines(), others=(A,))
    with pytest.raises(UpstreamError, match="decode-a broke off its answer") as info:
        list(moved.lines(_broken(Piece(text="Hel"))))
    assert "resum" not in info.value.message and marked == [] and moved.moves == []


def test_a_stream_ended_without_its_last_line_moves_too():
    moved, _ = _continuation(_lines(*[Piece(text="a"), Piece(text="b"), Final("stop")]))
    assert list(moved.lines(_broken(Piece(text="a"), error=False))) == [Piece(text="a"), Piece(text="b"), Final("stop")]
    assert "without a final line" in moved.moves[0]["reason"]


def test_the_moves_reach_the_caller_as_request_metrics():
    moved, _ = _continuation(_lines(*[Piece(text="Hel"), Piece(text="lo"), Final("stop")]))
    list(moved.lines(_broken(Piece(text="Hel"))))
    metrics = RequestMetrics(method=Method.KV_HANDOFF, decode_server=B.entry.address, prompt_tokens=10,
                             warnings=("earlier",))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        annotated = moved.annotate(metrics)
    (move,) = annotated.resumed
    assert move == Move(from_decode_server=A.entry.address, to_decode_server=B.entry.address,
                        to_prefill_server=P.entry.address, method=Method.KV_HANDOFF, after_pieces=1,
                        reason="decode-a broke off its answer: ChunkedEncodingError", pieces_replayed=1,
                        tokens_recomputed=11)
    assert annotated.tokens_recomputed_by_moves == 11
    assert annotated.warnings[:2] == ("earlier", "a note") and "failed mid-answer" in annotated.warnings[2]
    assert [w.category for w in caught] == [resume.ResumeWarning]
    given = annotated.as_dict()
    assert given["resumed"] == [{**move.as_dict(), "method": "kv_handoff"}] and given["tokens_recomputed_by_moves"] == 11
    assert RequestMetrics.from_dict(given) == annotated
    assert "resumed" not in metrics.as_dict() and "tokens_recomputed_by_moves" not in metrics.as_dict()
    assert resume.describe([], metrics) is metrics


def test_a_whole_answer_that_broke_off_is_told_in_its_metrics():
    local = SimpleNamespace()
    resume.begin(local)
    resume.broke_off(local, A, 5, UpstreamError("decode-a went silent", transport=True))
    resume.broke_off(local, A, 0, UpstreamError("decode-a refused", transport=True))  # nothing had come: no move
    resume.broke_off(local, A, 3, UpstreamError("decode-a answered 400", transport=False))  # answered: no move
    metrics = RequestMetrics(method=Method.DECODE_ONLY_FALLBACK, decode_server=B.entry.address, prompt_tokens=4)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        (move,) = resume.finish(local, metrics).resumed
    assert move.method == Method.DECODE_ONLY_FALLBACK and move.to_prefill_server is None
    assert move.after_pieces == 5 and move.tokens_recomputed == 9
    assert resume.finish(local, metrics) is metrics  # the request's moves were taken
