# Included by llama.cpp's top-level project() (CMAKE_PROJECT_llama.cpp_INCLUDE, set in
# .ci/run): the tools other than llama-server (quantize, bench, tts, the CLIs, ...) are added
# EXCLUDE_FROM_ALL, so the sdist's `cmake --build .` builds only the server and what it
# links (ggml, llama, common, mtmd are its dependencies and are built as such).
function(add_subdirectory dir)
    if(CMAKE_CURRENT_SOURCE_DIR MATCHES "/tools$" AND NOT dir STREQUAL "server")
        _add_subdirectory(${dir} ${ARGN} EXCLUDE_FROM_ALL)
    else()
        _add_subdirectory(${dir} ${ARGN})
    endif()
endfunction()
