"""Offline tools: GRPO request traces and the replay simulator that scores routing policies on them.

`trace` (synthetic and tokenizer-real GRPO traces), `routing_sim` (replays a trace through a policy). Imports
`routing`.
"""
