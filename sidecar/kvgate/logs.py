"""Logging for kvgate's commands: one ``--log-level`` (checked, with the choices in the error) and an
optional JSON-lines format for log shippers."""

from __future__ import annotations

import argparse
import json
import logging
import time

LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


def level(value: str) -> str:
    """argparse type: a level name in any case, else a clear usage error (not a traceback)."""
    name = value.upper()
    if name not in LEVELS:
        raise argparse.ArgumentTypeError(f"{value!r} is not a log level; choose one of {', '.join(LEVELS)}")
    return name


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--log-level", type=level, default="WARNING", metavar="LEVEL", help=", ".join(LEVELS))
    p.add_argument("--log-format", choices=("text", "json"), default="text", help="json: one object per line")


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        out = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname,
            "logger": record.name,
            "msg": record.getMessage(),
        }
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, ensure_ascii=False)


def setup(args: argparse.Namespace) -> None:
    handler = logging.StreamHandler()
    if getattr(args, "log_format", "text") == "json":
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s %(message)s"))
    logging.basicConfig(level=args.log_level, handlers=[handler])
