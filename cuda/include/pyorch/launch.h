// Process-wide launch settings of the op library. No CUDA types: cpp/ may include it anywhere.
#pragma once

namespace pyorch {

// Programmatic dependent launch (PDL, compute capability 9.0+; see cuda/common/launch.cuh): on
// unless turned off here. set_pdl_enabled(false) makes every pyorch kernel launched afterwards a
// plain launch, including those whose caller asked for PDL (SkinnyGemmConfig::pdl): a kill switch
// for A/B timing or a driver that mishandles PDL. Set it once at start-up, before any graph is
// captured (a captured graph keeps the launches it recorded). pyorch sets it from PYORCH_PDL when
// its extension loads (pyorch/__init__.py). Safe to call from any thread.
void set_pdl_enabled(bool enabled);

// Whether pyorch kernels launch with PDL on the current device: the setting above is on and the
// device has compute capability 9.0+.
bool pdl_enabled();

}  // namespace pyorch
