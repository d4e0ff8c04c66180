"""Engine outputs -> OpenAI wire shapes: a choice's tokens, text and logprobs as completion
and chat choices, stream chunks and logprob blocks (and tool calls, parsed out of a chat's
text when the request had tools)."""

from __future__ import annotations

from typing import Any

from console.schemas import (ChatChoice, ChatChunkChoice, ChatDelta, ChatLogprobs, ChatResponseMessage,
                             ChatTokenLogprob, CompletionChoice, CompletionLogprobs, FunctionDelta, PromptLogprob,
                             ToolCallDelta, TopLogprob)
from console.structured import ToolStream, parse_tool_calls, tool_finish_reason


class Formatter:
    """Turns a choice's tokens and logprobs into OpenAI choices, chunks and logprob blocks.
    `job` is console.api.Job (duck-typed: prompt_ids, text, token_ids, logprobs,
    finish_reason, stop_reason, offset)."""

    def __init__(self, tokenizer: Any, wants_logprobs: bool, echo: bool = False, tools: Any = None,
                 prompt_top: int | None = None):
        self.tok = tokenizer
        self.prompt_top = prompt_top    # vLLM's prompt_logprobs: N (None: not asked)
        self.wants_logprobs = wants_logprobs
        self.echo = echo
        self.tools = tools          # console.structured.ToolPlan of a chat with tools, or None
        self._streams: dict[int, Any] = {}

    def token(self, token_id: int) -> str:
        return self.tok.decode([token_id], skip_special_tokens=False)

    def _completion_lp(self, job: Any, ids: list[int], lps: list[Any]) -> CompletionLogprobs | None:
        if not self.wants_logprobs:
            return None
        toks = [self.token(i) for i in ids]
        offsets = []
        for t in toks:  # text_offset counts characters from the start of the choice's text
            offsets.append(job.offset)
            job.offset += len(t)
        return CompletionLogprobs(toks, [lp[0] if lp else None for lp in lps],
                                  [{self.token(i): v for i, v in lp[1]} if lp else None for lp in lps], offsets)

    def completion_echo(self, job: Any) -> CompletionChoice:
        lps = job.prompt_logprobs or [None] * len(job.prompt_ids)  # (asked with echo + logprobs)
        return CompletionChoice(job.index, self.tok.decode(job.prompt_ids),
                                self._completion_lp(job, job.prompt_ids, lps), None)

    def prompt_logprobs(self, job: Any, entries: list[Any] | None) -> list[dict[str, PromptLogprob] | None] | None:
        if not self.prompt_top or entries is None:
            return None
        out: list[dict[str, PromptLogprob] | None] = [None]
        for tid, e in zip(job.prompt_ids[1:], entries[1:]):
            chosen, top = e
            ranks = {t: r for r, (t, _) in enumerate(top, 1)}
            d = {str(tid): PromptLogprob(chosen, ranks.get(tid), self.token(tid))}
            for t, v in top[:self.prompt_top]:
                d.setdefault(str(t), PromptLogprob(v, ranks[t], self.token(t)))
            out.append(d)
        return out

    def completion_delta(self, job: Any, out: Any) -> CompletionChoice:
        return CompletionChoice(job.index, out.text, self._completion_lp(job, out.token_ids, out.logprobs),
                                out.finish_reason, out.stop_reason, self.prompt_logprobs(job, out.prompt_logprobs))

    def completion_choice(self, job: Any) -> CompletionChoice:
        job.offset = 0
        head = self.completion_echo(job) if self.echo else None
        lp = self._completion_lp(job, job.token_ids, job.logprobs)
        if head is not None and head.logprobs is not None and lp is not None:
            lp = CompletionLogprobs(*(getattr(head.logprobs, f) + getattr(lp, f) for f in
                                      ("tokens", "token_logprobs", "top_logprobs", "text_offset")))
        return CompletionChoice(job.index, (head.text if head else "") + "".join(job.text), lp,
                                job.finish_reason, job.stop_reason, self.prompt_logprobs(job, job.prompt_logprobs))

    def _chat_lp(self, ids: list[int], lps: list[Any]) -> ChatLogprobs | None:
        if not self.wants_logprobs:
            return None

        def entry(i: int, v: float) -> tuple[str, float, list[int]]:
            t = self.token(i)
            return t, v, list(t.encode())

        return ChatLogprobs([ChatTokenLogprob(*entry(i, lp[0]), [TopLogprob(*entry(t, v)) for t, v in lp[1]])
                             for i, lp in zip(ids, lps)])

    def chat_delta(self, job: Any, out: Any) -> ChatChunkChoice:
        lp = self._chat_lp(out.token_ids, out.logprobs)
        if self.tools is None:
            delta = ChatDelta(content=out.text) if out.text or not out.finished else ChatDelta()
            return ChatChunkChoice(job.index, delta, lp, out.finish_reason, out.stop_reason)
        ts = self._streams.setdefault(job.index, ToolStream(self.tools))
        text, calls = ts.feed(out.text), []
        if out.finished:
            tail, calls = ts.finish()
            text += tail
        deltas = [ToolCallDelta(i, c.id, "function", FunctionDelta(c.function.name, c.function.arguments))
                  for i, c in enumerate(calls)]
        delta = ChatDelta(content=text or (None if out.finished else ""), tool_calls=deltas or None)
        return ChatChunkChoice(job.index, delta, lp, tool_finish_reason(calls, out.finish_reason), out.stop_reason)

    def chat_choice(self, job: Any) -> ChatChoice:
        text, calls, reason = "".join(job.text), None, job.finish_reason
        if self.tools is not None:
            content, found = parse_tool_calls(text, self.tools)
            if found:  # a forced call cut by max_tokens is still a call, with finish_reason "length"
                text, calls, reason = content, found, tool_finish_reason(found, reason)
        return ChatChoice(job.index, ChatResponseMessage(text, tool_calls=calls),
                          self._chat_lp(job.token_ids, job.logprobs), reason, job.stop_reason)
