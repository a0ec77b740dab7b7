"""`POST /v1/chat/completions`: messages through the chat template → `n` assistant messages, whole or streamed as
server-sent events. The conversation's prompt, tools and reasoning are conversation.py's; this module translates the
replies into OpenAI's message and chunk shapes (`reasoning_content` with a reasoning parser, `tool_calls`). Streams
send content and reasoning as they grow and each call whole once its JSON closes.
"""
from __future__ import annotations

from cpinfer.server import protocol as P
from cpinfer.server.conversation import ReplyParser, prepare  # noqa: F401 - ReplyParser: the API of this module
from cpinfer.server.outputs import Progress, chat_logprobs, usage, usage_of
from cpinfer.server.pipeline import API, Job
from cpinfer.server.state import dump


class ChatAPI(API):
    request_model = P.ChatCompletionRequest
    endpoint = "chat"
    id_prefix = "chatcmpl-"

    async def prepare(self) -> Job:
        chat = await prepare(self.server, self.req)
        self.replies = chat.replies
        self.opened = [False] * len(self.replies)
        return chat.job

    def response(self, outs: list) -> P.ChatCompletionResponse:
        choices = [self._choice(i, out) for i, out in enumerate(outs)]
        return P.ChatCompletionResponse(id=self.rid, created=self.created, model=self.server.name, choices=choices,
                                        usage=usage_of(outs, self.req.n))

    def _choice(self, index: int, out) -> P.ChatChoice:
        reply, req = self.replies[index], self.req
        lp = chat_logprobs(self.server.tokenizer, out, range(len(out.token_ids))) if req.logprobs else None
        piece = reply.whole(out)
        if reply.mode is not None:  # a constrained call: the whole output is its JSON
            msg = P.AssistantMessage(content=None if piece.calls else piece.content,
                                     tool_calls=_response_calls(piece.calls) or None)
        else:
            msg = P.AssistantMessage(content=piece.content if piece.content or not piece.calls else None,
                                     reasoning_content=piece.reasoning if reply.has_reasoning else None,
                                     tool_calls=_response_calls(piece.calls) or None)
        return P.ChatChoice(index=index, message=msg, logprobs=lp, finish_reason=piece.finish,
                            stop_reason=out.stop_reason)

    # ------------------------------------------------------------------ streamed
    def _chunk(self, choice: P.ChatChunkChoice, out) -> dict:
        if not self.opened[choice.index]:  # the role goes with a choice's first token (as vLLM sends it), never
            self.opened[choice.index] = True  # before prefill: clients time the first token by the first chunk
            choice.delta.role = "assistant"
        body = dump(P.ChatCompletionChunk(id=self.rid, created=self.created, model=self.server.name,
                                          choices=[choice]))
        delta = body["choices"][0]["delta"]
        body["choices"][0]["delta"] = {k: v for k, v in delta.items() if v is not None}  # as OpenAI sends it
        if self.req.continuous_usage:
            body["usage"] = usage(out).model_dump()
        elif not self.req.include_usage:
            body.pop("usage")
        return body

    def events(self, i: int, out, progress: Progress) -> list[dict]:
        reply = self.replies[i]
        if reply.mode is not None:  # a required / named call is sent whole, once the output is complete
            if not out.finished:
                progress.last = out
                return []
            progress.advance(out)
            msg = self._choice(i, out).message
            delta = (P.DeltaMessage(tool_calls=[P.DeltaToolCall(index=k, **c.model_dump())
                                                for k, c in enumerate(msg.tool_calls)])
                     if msg.tool_calls else P.DeltaMessage(content=msg.content))
            finish = "tool_calls" if msg.tool_calls else out.finish_reason
            return [self._chunk(P.ChatChunkChoice(index=i, delta=delta, finish_reason=finish,
                                                  stop_reason=out.stop_reason), out)]
        _, new = progress.advance(out)
        piece = reply.delta(out)
        if not (piece.reasoning or piece.content or piece.calls or len(new) or out.finished):
            return []
        calls = [P.DeltaToolCall(index=piece.first + k, id=c.id,
                                 function=P.ResponseFunctionCall(name=c.name, arguments=c.arguments))
                 for k, c in enumerate(piece.calls)]
        delta = P.DeltaMessage(content=piece.content or None, reasoning_content=piece.reasoning or None,
                               tool_calls=calls or None)
        if not (piece.reasoning or piece.content or piece.calls) and not out.finished:
            delta.content = ""  # log-probabilities of tokens that add no text yet
        lp = chat_logprobs(self.server.tokenizer, out, new) if self.req.logprobs else None
        return [self._chunk(P.ChatChunkChoice(index=i, delta=delta, logprobs=lp, finish_reason=piece.finish,
                                              stop_reason=out.stop_reason if out.finished else None), out)]

    def closing(self, outs: list) -> list[dict]:
        if not self.req.include_usage:
            return []
        return [dump(P.ChatCompletionChunk(id=self.rid, created=self.created, model=self.server.name, choices=[],
                                           usage=usage_of(outs, self.req.n)))]


def _response_calls(calls) -> list[P.ResponseToolCall]:
    return [P.ResponseToolCall(id=c.id, function=P.ResponseFunctionCall(name=c.name, arguments=c.arguments))
            for c in calls]
