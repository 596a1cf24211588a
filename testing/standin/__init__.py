"""A STAND-IN inference server (vLLM / SGLang flavoured) on the simulated device.

vLLM and SGLang cannot run here, so tests and examples start this instead
(``python -m timeslice.testing.standin.server``): the same sleep/wake and release/resume
endpoints, real bytes on the simulated device, generate requests in flight, injected faults.
``server`` (the process), ``memory`` (its regions), ``engine`` (requests in flight and pause
modes), ``routes`` (its HTTP routes).
"""
