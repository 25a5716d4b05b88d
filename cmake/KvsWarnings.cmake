# Warnings on, for our own targets only (third-party headers come in as SYSTEM).
function(kvs_target_warnings target)
  target_compile_options(${target} PRIVATE
    $<$<COMPILE_LANGUAGE:CXX>:-Wall -Wextra -Wno-unused-parameter>
    $<$<COMPILE_LANGUAGE:CUDA>:-Xcompiler=-Wall,-Wextra,-Wno-unused-parameter --expt-relaxed-constexpr>)
endfunction()
