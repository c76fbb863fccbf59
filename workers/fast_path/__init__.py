"""The CPU fast path's Python side, one folder: families describe their layers to the C++ step (fused_stage), the
runner hands a multi-step call's later steps to LaterStepCalls (later_step_calls, later_steps), and a call's grammars
advance between its C++ steps (step_grammars). The kernels it drives live in kernels/ (cpu_*.py, csrc/)."""
