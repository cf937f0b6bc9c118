"""agentcache.content: a message's content flattened to text, the parts the caller does not read refused."""

import pytest

from agentcache.content import flatten_content, text_block


def _refuse(part):
    raise ValueError(f"cannot read {part!r}")


def test_a_string_is_itself_and_a_lists_string_parts_are_joined():
    assert flatten_content("as is", _refuse) == "as is"
    assert flatten_content(["a", "b"], _refuse) == "ab"
    assert flatten_content(["a", "b"], _refuse, separator="\n") == "a\nb"
    assert flatten_content([], _refuse) == ""


def test_other_parts_are_the_readers_to_read_leave_out_or_refuse():
    def read(part):
        text = text_block(part)
        if text is None and part.get("type") != "skip":
            _refuse(part)
        return text

    parts = ["a", {"type": "text", "text": "b"}, {"type": "skip"}, {"type": "text"}, "c"]
    assert flatten_content(parts, read, separator="|") == "a|b||c"  # a text part without text reads as ""
    with pytest.raises(ValueError, match="image"):  # the first part refused is the one named
        flatten_content(["a", {"type": "image"}, 1], read)


def test_text_block_reads_typed_text_parts_only():
    assert text_block({"type": "text", "text": 3}) == "3"
    assert text_block({"type": "image_url"}) is None and text_block("text") is None
