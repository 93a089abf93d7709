"""Envs from the job's config: the class by import path, wrapped for the rollout (`make_env_factory`).

Above both `envs.base` and `envs.chat` (it wraps chat envs in the chat adapter), so neither imports back.
"""

from __future__ import annotations

import inspect
from concurrent.futures import Executor
from typing import Any, Callable

from envs.base import Env, SyncEnv, SyncEnvAdapter
from envs.chat import ChatEnv, ChatEnvAdapter
from envs.plugins import load_by_path


def load_env_class(import_path: str) -> type:
    """Import an env class from "pkg.module:ClassName" or "pkg.module.ClassName".

    The class must subclass `Env`, `SyncEnv` or `envs.chat.ChatEnv`; anything else is refused with a
    message that says what was found and what is expected.
    """
    env_cls = load_by_path(import_path, "env class", "envs.sentiment:SentimentEnv")
    if not (inspect.isclass(env_cls) and issubclass(env_cls, (Env, SyncEnv, ChatEnv))):
        raise TypeError(
            f"{import_path!r} is {env_cls!r}, not an environment class: subclass envs.base.Env (async), "
            "envs.base.SyncEnv (blocking) or envs.chat.ChatEnv (chat messages and tools)"
        )
    return env_cls


def make_env_factory(env_cls: type | str, env_kwargs: dict | None = None,
                     executor: Executor | None = None, chat: Any = None) -> Callable[[], Env]:
    """A zero-argument callable building one async `Env` per call (for `EnvPool`).

    `env_cls` may be a class or an import path. `SyncEnv` classes are wrapped in
    `SyncEnvAdapter` running on `executor` (required for them); `ChatEnv` classes get `chat`'s
    toolbox and are wrapped in `ChatEnvAdapter` with its tokenizer and tool-call parser
    (`envs.chat.ChatSetup`, required for them).
    """
    if isinstance(env_cls, str):
        env_cls = load_env_class(env_cls)
    kwargs = dict(env_kwargs or {})
    if issubclass(env_cls, SyncEnv) and executor is None:
        raise ValueError(f"{env_cls.__name__} is a blocking SyncEnv: pass an executor (envs.threads.make_executor(n))")
    is_chat = issubclass(env_cls, ChatEnv) or getattr(env_cls, "wants_chat", False)
    if is_chat and chat is None:
        raise ValueError(f"{env_cls.__name__} is a ChatEnv: pass chat=envs.chat.ChatSetup(tokenizer, toolbox, parser)")
    if not is_chat and chat is not None and chat.toolbox is not None:
        raise ValueError(f"env.tools is set but {env_cls.__name__} is not a chat env that calls them: subclass "
                         "envs.chat.ChatEnv (or use envs.chat:ToolUseEnv), or remove env.tools")

    def build() -> Env:
        if getattr(env_cls, "wants_chat", False):  # an Env that renders chats itself (envs/agent.py)
            return env_cls(chat=chat, **kwargs)
        if is_chat:
            return ChatEnvAdapter(env_cls(toolbox=chat.toolbox, **kwargs), chat.tokenizer, chat.parser,
                                  chat.max_result_tokens, chat.template_kwargs)
        env = env_cls(**kwargs)
        return SyncEnvAdapter(env, executor) if isinstance(env, SyncEnv) else env

    return build
