"""Every place hf-dflash touches the internals of `transformers serve` (and of uvicorn, which runs it), in one file.

transformers serve has no hook for a drafter. `drafter_in_transformers_serve` starts nothing itself: for as long as
it is active, three names transformers serve looks up when it starts are replaced, each by a subclass or a wrapper
of the original, and `transformers.cli.serve.Serve` then runs as it always does:

1. The class that loads models gets a subclass that, once transformers has loaded the target, runs
   `ServedTarget.prepare` on it (which attaches the drafter, see `serve.attach_drafter`), and that loads a bundled
   target by name from its folder.
   - transformers 5.25 and later: `model_manager.ModelLoader`. The model loads in a process of its own (spawned),
     to which the loader travels pickled, with its `ServedTarget`.
   - transformers 5.17 to 5.25: `model_manager.ModelManager`, which loads the model in the server's process; its
     `shutdown` also stops the managers the target started (their worker threads would keep the process alive).
2. `server.build_server`: the app it builds gets `RequestChecks` in front of the generation endpoints, JSON
   answers for a ValueError (400) and a RuntimeError (500) where it has none (5.17 answers a plain-text 500 for
   both), and `GET /dflash/state` (the served manager's requests and pools, see `serve.served_state`).
3. `uvicorn.Config`: a bound on the graceful shutdown. On SIGTERM uvicorn stops accepting and waits for the
   responses in flight, by default without limit; past the bound it cancels them, which cancels their requests.

`Serve`'s own parameters are read from its signature (`serve_options`), so `hf-dflash serve` takes exactly the
options of the transformers installed.
"""

from __future__ import annotations

import functools
import inspect
import typing
import weakref
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Iterator

from transformers.cli import serve as serve_command
from transformers.cli.serving import model_manager, server
from transformers.cli.serving import utils as serving_utils

from .serve_requests import RequestChecks

if TYPE_CHECKING:
    from .serve import ServedTarget

# transformers 5.25 moved model loading into a process of its own, behind `ModelLoader`.
MODELS_LOAD_IN_THEIR_OWN_PROCESS = hasattr(model_manager, "ModelLoader")
# From 5.25 (`CBGenerateRunner`) each continuous-batching request carries its own temperature, top-k and top-p;
# before, the manager takes the sampling settings of the server's first request for all the others.
SAMPLES_PER_REQUEST = hasattr(serving_utils, "CBGenerateRunner")
STATE_ROUTE = "/dflash/state"

# The target served while `drafter_in_transformers_serve` is active, read by the classes below as transformers
# serve builds them (its constructors take no argument of ours).
_active: ServedTarget | None = None


# --------------------------------------------------------------------------------------------------
# 1. Loading the target, and the drafter with it
# --------------------------------------------------------------------------------------------------

if MODELS_LOAD_IN_THEIR_OWN_PROCESS:

    class DrafterModelLoader(model_manager.ModelLoader):
        """transformers serve's `ModelLoader`, which also prepares the target it loads (`ServedTarget.prepare`),
        in the model's process."""

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.served = _active  # pickled with the loader into the model's process

        def _loadable(self, model_id: str) -> str:
            repo, _, _ = serving_utils.parse_model_id(model_id)
            return self.served.folder if self.served.folder and repo == self.served.name else model_id

        def load_config(self, model_id: str) -> Any:
            return super().load_config(self._loadable(model_id))

        def load_processor(self, model_id: str) -> Any:
            return super().load_processor(self._loadable(model_id))

        def load_model_and_processor(self, model_id: str, on_progress: Any = None) -> tuple[Any, Any]:
            model, processor = super().load_model_and_processor(self._loadable(model_id), on_progress)
            self.served.prepare(model)
            return model, processor

    REPLACED_LOADER = ("ModelLoader", DrafterModelLoader)

    async def _served_state(manager: Any) -> dict:
        # transformers serve runs `function(model, processor)` in the model's process and returns its result
        from .serve import read_served_state

        return await manager.get_engine(None).submit(read_served_state)

else:

    class DrafterModelManager(model_manager.ModelManager):
        """transformers serve's `ModelManager`, which also prepares each target it loads (`ServedTarget.prepare`),
        and stops the continuous-batching managers those targets started when it shuts down."""

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            self.served = _active
            self.prepared: weakref.WeakSet = weakref.WeakSet()
            super().__init__(*args, **kwargs)  # loads the target of the command line

        def load_model_and_processor(self, model_id_and_revision: str, *args: Any, **kwargs: Any) -> tuple[Any, Any]:
            repo, _, revision = model_id_and_revision.partition("@")
            if self.served.folder and repo == self.served.name:
                model_id_and_revision = f"{self.served.folder}@{revision}"
            model, processor = super().load_model_and_processor(model_id_and_revision, *args, **kwargs)
            if model not in self.prepared:  # called on every request: the model is cached
                self.served.prepare(model)
                self.prepared.add(model)
            return model, processor

        def shutdown(self) -> None:
            from .serve import stop_managers

            for model in list(self.prepared):
                stop_managers(model)
            super().shutdown()

    REPLACED_LOADER = ("ModelManager", DrafterModelManager)

    async def _served_state(manager: Any) -> dict:
        from .serve import read_served_state

        (model,) = list(manager.prepared)  # a server with a drafter serves its one target
        return read_served_state(model, None)


# --------------------------------------------------------------------------------------------------
# 2. The app: request checks, 400 for a ValueError, the state route
# --------------------------------------------------------------------------------------------------


def _with_checks(build_server: Any) -> Any:
    @functools.wraps(build_server)
    def build(manager: Any, *args: Any, **kwargs: Any) -> Any:
        from fastapi.responses import JSONResponse

        app = build_server(manager, *args, **kwargs)
        app.add_middleware(RequestChecks, limits=_active.limits)
        # A request's fault (a ValueError: what the manager refuses) is a 400; a failure while generating it is a
        # 500; both as JSON, the body transformers serve's own errors have. Handlers it has already stay.
        for error_class, status in ((ValueError, 400), (RuntimeError, 500)):
            if error_class not in app.exception_handlers:
                app.add_exception_handler(error_class, _json_error(status))

        async def state() -> JSONResponse:
            return JSONResponse(await _served_state(manager))

        app.add_api_route(STATE_ROUTE, state, methods=["GET"])
        return app

    return build


def _json_error(status: int) -> Any:
    from fastapi.responses import JSONResponse

    async def answer(_request: Any, error: Exception) -> JSONResponse:
        # `detail` as FastAPI answers, and OpenAI's `error.message`, which OpenAI clients put in their exception
        kind = "server_error" if status >= 500 else "invalid_request_error"
        return JSONResponse({"detail": str(error), "error": {"message": str(error), "type": kind}}, status_code=status)

    return answer


# --------------------------------------------------------------------------------------------------
# 3. A bounded graceful shutdown
# --------------------------------------------------------------------------------------------------


def _bounded_shutdown_config(seconds: float) -> type:
    import uvicorn

    class BoundedShutdownConfig(uvicorn.Config):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            kwargs.setdefault("timeout_graceful_shutdown", seconds)
            super().__init__(*args, **kwargs)

    return BoundedShutdownConfig


# --------------------------------------------------------------------------------------------------
# All three, for the life of a server
# --------------------------------------------------------------------------------------------------


@contextmanager
def drafter_in_transformers_serve(served: ServedTarget, graceful_shutdown_seconds: float = 30) -> Iterator[None]:
    """While active, `transformers.cli.serve.Serve(served.name, continuous_batching=True, ...)` serves
    `served.name` with its drafter attached (see the module's docstring for what changes). One server at a time."""
    import uvicorn

    global _active
    if _active is not None:
        raise RuntimeError("a server with a drafter is already starting or running in this process")
    loader_name, loader_class = REPLACED_LOADER
    replaced = [
        (model_manager, loader_name, loader_class),
        (server, "build_server", _with_checks(server.build_server)),
        (uvicorn, "Config", _bounded_shutdown_config(graceful_shutdown_seconds)),
    ]
    originals = [(module, name, getattr(module, name)) for module, name, _ in replaced]
    _active = served
    for module, name, value in replaced:
        setattr(module, name, value)
    try:
        yield
    finally:
        for module, name, value in originals:
            setattr(module, name, value)
        _active = None


# --------------------------------------------------------------------------------------------------
# transformers serve's options, read from `Serve`'s signature
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ServeOption:
    """One parameter of `transformers.cli.serve.Serve`, as an argparse option (`--name`)."""

    name: str
    kind: type  # bool, int, float, str, or an Enum
    default: Any
    help: str
    hidden: bool


def serve_options() -> list[ServeOption]:
    """The options of the installed transformers' `Serve` (all but the model, its one positional argument)."""
    options = []
    for name, parameter in inspect.signature(serve_command.Serve.__init__).parameters.items():
        if name in ("self", "force_model"):
            continue
        kind, info = typing.get_args(parameter.annotation)[:2]
        kind = next((arg for arg in typing.get_args(kind) if arg is not type(None)), kind)  # X | None -> X
        options.append(ServeOption(name, kind, parameter.default, info.help or "", bool(info.hidden)))
    return options


def run_serve(served: ServedTarget, options: dict[str, Any]) -> None:
    """transformers serve's `Serve(served.name, **options)`: serves until the server stops."""
    serve_command.Serve(served.name, **options)


__all__ = [
    "MODELS_LOAD_IN_THEIR_OWN_PROCESS",
    "SAMPLES_PER_REQUEST",
    "STATE_ROUTE",
    "ServeOption",
    "drafter_in_transformers_serve",
    "run_serve",
    "serve_options",
]
