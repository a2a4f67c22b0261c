"""Chat turns and the contexts they leave.

    turn.py             a chat turn as a scheduler request (ChatTurn, ChatTurns, ChatInfo):
                        it plans the turn, then carries the plan out
    plan.py             the plan: what prefix is reused, what is fused, what is prefilled and
                        what is saved, computed before any row is
    conversation.py     chat messages as token ids (the chat template, roles kept)
    contexts.py         cached contexts found by token prefix, the ContextStore protocol and
                        ContextCache (this process)
    session_store.py    RedisSessions: sessions shared by replicas through Redis (the same protocol)
    shared_contexts.py  anonymous contexts published to Redis, found by any replica by prefix
    context_blob.py     a context as one checked blob

The modules are imported by their own names (ragkv.app.chat.turn, ...); this package
imports none of them, so a module that needs only contexts loads no model code.
"""
