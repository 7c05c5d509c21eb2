# Shared build helpers: warnings on our own targets, sanitizers, and one way to add a test.

# numoe_target_defaults(<target>): -Wall -Wextra -Werror on our code (no -Werror in the clang fuzz tree, whose
# warnings differ from g++'s; the g++ trees enforce them), sanitizers when asked. CUDA sources
# get the same host-compiler warnings (nvcc hands -Xcompiler flags to g++ for the host side) and nvcc's own
# warnings as errors (device code: unused variables, deprecated APIs, ...).
function(numoe_target_defaults target)
  target_compile_options(${target} PRIVATE
    $<$<COMPILE_LANGUAGE:CXX>:-Wall -Wextra $<$<NOT:$<BOOL:${NUMOE_FUZZ}>>:-Werror> -Wno-missing-field-initializers>
    $<$<COMPILE_LANGUAGE:CUDA>:-Xcompiler=-Wall,-Wextra,-Werror,-Wno-missing-field-initializers
                               --Werror=all-warnings>)
  if(NUMOE_SANITIZE)
    target_compile_options(${target} PRIVATE -fsanitize=address,undefined -fno-omit-frame-pointer
                           -fno-sanitize-recover=undefined)
    target_link_options(${target} PRIVATE -fsanitize=address,undefined)
  endif()
endfunction()

# numoe_add_library(<name> SOURCES ... [LIBS ...] [PUBLIC_LIBS ...])
function(numoe_add_library name)
  cmake_parse_arguments(A "" "" "SOURCES;LIBS;PUBLIC_LIBS" ${ARGN})
  add_library(${name} STATIC ${A_SOURCES})
  target_include_directories(${name} PUBLIC ${PROJECT_SOURCE_DIR})
  target_link_libraries(${name} PUBLIC ${A_PUBLIC_LIBS} PRIVATE ${A_LIBS})
  numoe_target_defaults(${name})
endfunction()

# numoe_add_binary(<name> SOURCES ... [LIBS ...]): lands in <build>/bin/.
function(numoe_add_binary name)
  cmake_parse_arguments(A "" "" "SOURCES;LIBS" ${ARGN})
  add_executable(${name} ${A_SOURCES})
  target_link_libraries(${name} PRIVATE ${A_LIBS})
  numoe_target_defaults(${name})
endfunction()

# numoe_add_test(<name> SOURCES ... [LIBS ...] LABELS unit|kernels|model|integration|gpu [TIMEOUT s])
# A GoogleTest binary registered with ctest as one test, linked with tests/support (numoe_test_support);
# NUMOE_TEST_DATA points at tests/data.
# Exit code 77 counts as skipped (e.g. no GPU / ISA absent).
function(numoe_add_test name)
  cmake_parse_arguments(A "" "TIMEOUT" "SOURCES;LIBS;LABELS;ARGS" ${ARGN})
  add_executable(${name} ${A_SOURCES})
  target_link_libraries(${name} PRIVATE ${A_LIBS} numoe_test_support GTest::gtest GTest::gmock GTest::gtest_main)
  target_compile_definitions(${name} PRIVATE NUMOE_TEST_DATA="${NUMOE_TEST_DATA}"
                             NUMOE_BIN_DIR="${CMAKE_RUNTIME_OUTPUT_DIRECTORY}")
  numoe_target_defaults(${name})
  add_test(NAME ${name} COMMAND ${name} ${A_ARGS})
  if(NOT A_TIMEOUT)
    set(A_TIMEOUT 600)
  endif()
  set_tests_properties(${name} PROPERTIES LABELS "${A_LABELS}" TIMEOUT ${A_TIMEOUT} SKIP_RETURN_CODE 77)
endfunction()
