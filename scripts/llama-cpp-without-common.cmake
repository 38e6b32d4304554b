# CMake project include for building llama-cpp-python without llama.cpp's "common" library:
#   CMAKE_ARGS="-DGGML_NATIVE=ON -DLLAVA_BUILD=OFF -DCMAKE_PROJECT_INCLUDE=$PWD/scripts/llama-cpp-without-common.cmake"
# llama-cpp-python forces LLAMA_BUILD_COMMON on for its multimodal library (mtmd), which LLAVA_BUILD=OFF leaves out;
# its Python bindings load libllama and ggml only. CMake runs this file after every project() call, so it runs again
# after llama.cpp's own project() and turns the forced value off before llama.cpp reads it. common (argument
# parsing, chat templates, downloads, and the HTTP library it alone links) is about half of the build's compile
# time; the libraries the bindings load are built as before.
set(LLAMA_BUILD_COMMON OFF CACHE BOOL "llama.cpp: build the common utils library" FORCE)
