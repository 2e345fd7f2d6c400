"""Runnable example folders written by ``spill example``: the relay (a build stopped inside tune
on one engine and machine, moved, finished on another, checked against an uninterrupted
reference within the measured noise floor).
"""
