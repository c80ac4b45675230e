"""The quart-trio application: blueprints, JSON errors, body limits.

Background workers are not started here: they run as siblings in the service's root
nursery (relay_trio.service), never in quart-trio's app nursery.
"""

from __future__ import annotations

from quart_trio import QuartTrio

from relay_trio.runtime import Pod
from relay_trio.web.errors import install_error_handlers

MAX_BODY_BYTES = 256 * 1024


def create_app(pod: Pod) -> QuartTrio:
    app = QuartTrio("relay_trio")
    app.config["MAX_CONTENT_LENGTH"] = MAX_BODY_BYTES
    app.config["PROVIDE_AUTOMATIC_OPTIONS"] = True
    app.config["JSON_SORT_KEYS"] = False
    app.extensions["relay_pod"] = pod
    install_error_handlers(app)
    from relay_trio.web import body_drain; body_drain.install(app)  # noqa: E702 (keep-alive after early rejections)

    from relay_trio.web import health

    blueprints = [health.bp]
    # Each feature module registers its blueprint here (one line each).
    from relay_trio.web import openapi; blueprints.append(openapi.bp)  # noqa: E702
    from relay_trio.web import events, listeners; blueprints += [events.bp, listeners.bp]  # noqa: E702
    from relay_trio.web import stream; blueprints.append(stream.bp)  # noqa: E702
    from relay_trio.web import ops; blueprints.append(ops.bp)  # noqa: E702
    from relay_trio.web import deliveries; blueprints.append(deliveries.bp)  # noqa: E702
    for bp in blueprints:
        app.register_blueprint(bp)
    return app
