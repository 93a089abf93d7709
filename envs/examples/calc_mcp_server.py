"""The tool recipe's calculator (envs/arithmetic_tools.py:calc) as an MCP server over stdio, so the recipe can
take its tool from a server instead of an import path:

    torchrun --nproc_per_node 2 -m rl_core.train --config grpo_tools_arithmetic.yaml \
        'env.tools=[{mcp: {command: [.venv/bin/python, -m, envs.examples.calc_mcp_server]}}]'

The same function behind both, so the template lists `calc(expr)` either way and the shipped policy reads
the same prompt. A bad expression is a tool error (`isError`) whose text the model reads.
"""

import functools

from mcp.server.mcpserver import MCPServer
from mcp.server.mcpserver.exceptions import ToolError

from envs import arithmetic_tools

server = MCPServer("calc", log_level="CRITICAL")  # stderr is the job's; a policy's bad calls are not news


@server.tool()
@functools.wraps(arithmetic_tools.calc)  # its signature and docstring: the schema the template renders
def calc(expr: str) -> str:
    try:
        return arithmetic_tools.calc(expr)
    except ValueError as err:  # the server hides other exceptions' text from the client; a ToolError's is sent
        raise ToolError(str(err)) from None


if __name__ == "__main__":
    server.run()  # stdio
