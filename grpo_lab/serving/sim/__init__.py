"""Offline tools: GRPO request traces and the replay simulator that scores routing policies on them. Imports
`routing`.
"""
