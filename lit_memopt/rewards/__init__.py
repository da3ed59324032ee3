"""Reward functions and the sandbox that executes generated code."""
