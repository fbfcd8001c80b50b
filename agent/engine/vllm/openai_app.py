"""vLLM's own OpenAI app, built over an ``EngineClient`` of ours (:mod:`agent.engine.vllm.engine_client`).

``vllm serve`` builds its FastAPI app with ``build_app(args, supported_tasks, model_config)`` and wires every
handler (chat and text completions, ``/tokenize``, ``/detokenize``, ``/v1/models``, ``/health``, ``/version``...)
to an engine client with ``init_app_state(engine_client, app.state, args, supported_tasks)``
(``vllm/entrypoints/openai/api_server.py``). :func:`build_openai_app` does the same with vLLM's own argument
parser, so any front-end flag of ``vllm serve`` (``--chat-template``, ``--api-key``, ``--enable-auto-tool-choice``,
``--response-role``...) can be given as ``frontend_args``, checked by vLLM.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Any

from agent.engine.vllm.engine_args import describable_platform

TASKS = ("generate",)
"""What trackside units serve through the app."""


class FrontendArgError(ValueError):
    """A front-end flag vLLM's parser refused (the message is vLLM's)."""


def frontend_tokens(items: Sequence[str]) -> list[str]:
    """``KEY=VALUE`` items (``chat_template=FILE``, ``enable_auto_tool_choice=true``) as ``vllm serve`` flags: a
    ``true`` value is the bare flag, ``false`` leaves it out; ``FrontendArgError`` for an item without ``=``."""
    tokens: list[str] = []
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise FrontendArgError(f"{item!r}: KEY=VALUE (a vllm serve front-end option, e.g. "
                                   "chat_template=FILE)")
        flag = "--" + key.strip().lstrip("-").replace("_", "-")
        if value.lower() == "true":
            tokens.append(flag)
        elif value.lower() != "false":
            tokens += [flag, value]
    return tokens


def frontend_namespace(model: str, served_model_name: str, frontend_args: Sequence[str] = ()) -> argparse.Namespace:
    """``vllm serve``'s parsed arguments for the app: the model and its served name, then ``frontend_args``."""
    from vllm.entrypoints.openai.cli_args import make_arg_parser, validate_parsed_serve_args
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    class Parser(FlexibleArgumentParser):  # type: ignore[misc]
        def error(self, message: str) -> Any:  # argparse's documented override: raise instead of exit
            raise FrontendArgError(message)

    with describable_platform():
        parser = make_arg_parser(Parser(prog="--openai-arg", add_help=False))
    args: argparse.Namespace = parser.parse_args(["--model", model, "--served-model-name", served_model_name,
                                                  "--disable-log-stats", *frontend_args])
    try:
        validate_parsed_serve_args(args)
    except (TypeError, ValueError) as exc:
        raise FrontendArgError(str(exc)) from exc
    return args


async def build_openai_app(client: Any, args: argparse.Namespace) -> Any:
    """vLLM's FastAPI app for ``client`` (an ``EngineClient``), every handler initialised."""
    from vllm.entrypoints.openai.api_server import build_app, init_app_state

    app = build_app(args, TASKS, client.model_config)
    await init_app_state(client, app.state, args, TASKS)
    return app


class FrontendModel:
    """The units' model as a front-end process sees it (``--openai-frontends``): the engine client's
    ``vllm_config``, ``model_config``, ``renderer`` and ``input_processor``, built from the main process's
    ``vllm_config`` the way vLLM's ``AsyncLLM`` builds its own (``renderer_from_config``, ``InputProcessor``), and
    the calls vLLM's app makes on every engine (profiling, cache resets) handed to ``call``, which asks the main
    process."""

    errored = False

    def __init__(self, vllm_config: Any, call: Any) -> None:
        from vllm.renderers import renderer_from_config
        from vllm.v1.engine.input_processor import InputProcessor

        self.vllm_config = vllm_config
        self.model_config = vllm_config.model_config
        self.renderer = renderer_from_config(vllm_config)
        self.input_processor = InputProcessor(vllm_config, self.renderer)
        self._call = call

    async def start_profile(self) -> None:
        await self._call("start_profile")

    async def stop_profile(self) -> None:
        await self._call("stop_profile")

    async def reset_mm_cache(self) -> None:
        await self._call("reset_mm_cache")

    async def reset_encoder_cache(self) -> None:
        await self._call("reset_encoder_cache")

    async def reset_prefix_cache(self, reset_running_requests: bool = False, reset_connector: bool = False) -> bool:
        return bool(await self._call("reset_prefix_cache", reset_running_requests, reset_connector))

    def shutdown(self) -> None:
        self.renderer.shutdown()
