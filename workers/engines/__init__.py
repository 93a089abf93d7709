"""Inference engines the job drives over SGLang's HTTP API: the embedded engine and real SGLang."""

# How long an engine keeps an idle client connection open. sglang-router pools its connections to
# the engines and reuses one idle for up to 50 s; a server that closes it sooner (SGLang's uvicorn:
# 5 s by default) races the router's reuse after every pause between rollouts, and the requests sent
# on the closed connections fail ("error sending request"; sglang issue #20851).
ENGINE_KEEPALIVE_S = 75  # aiohttp's default, so the embedded engine keeps what it always had
