# numoe-router's integration tests (label integration): the router against fake workers over loopback.
numoe_add_binary(router_fake_worker SOURCES router_fake_worker.cc LIBS numoe_tokenizer numoe_proto numoe_common)

numoe_add_test(router_integration_test
  SOURCES router_integration_test.cc
  LIBS numoe_proto numoe_common nlohmann_json::nlohmann_json
  LABELS integration TIMEOUT 300)
add_dependencies(router_integration_test numoe-router router_fake_worker)

# The REST API through the official npm clients, `openai` and `@anthropic-ai/sdk` (each test skipped, exit
# 77, when node/npm or the registry is unreachable).
foreach(client openai anthropic)
  add_test(NAME router_${client}_node
    COMMAND bash ${CMAKE_CURRENT_SOURCE_DIR}/node/run_node_test.sh $<TARGET_FILE:numoe-router>
            $<TARGET_FILE:router_fake_worker> ${NUMOE_TEST_DATA}/tiny-v4 ${CMAKE_CURRENT_BINARY_DIR}/node-${client}
            ${client}_test.mjs)
  set_tests_properties(router_${client}_node PROPERTIES LABELS integration SKIP_RETURN_CODE 77 TIMEOUT 300)
endforeach()
# The same `openai` client over HTTPS (--tls-cert/--tls-key, a certificate made by the openssl command),
# trusting it through a custom https.Agent.
add_test(NAME router_tls_node
  COMMAND bash ${CMAKE_CURRENT_SOURCE_DIR}/node/run_node_test.sh $<TARGET_FILE:numoe-router>
          $<TARGET_FILE:router_fake_worker> ${NUMOE_TEST_DATA}/tiny-v4 ${CMAKE_CURRENT_BINARY_DIR}/node-tls
          tls_test.mjs tls)
set_tests_properties(router_tls_node PROPERTIES LABELS integration SKIP_RETURN_CODE 77 TIMEOUT 300)

# Sampling (logprobs against the goldens, n, penalties, logit_bias, min_p) through the `openai` npm client
# against `numoe serve` on tiny-v4 with the real CPU backend (skipped like router_openai_node).
add_test(NAME sampling_openai_node
  COMMAND bash ${CMAKE_CURRENT_SOURCE_DIR}/node/run_serve_test.sh $<TARGET_FILE:numoe> ${NUMOE_TEST_DATA}/tiny-v4
          ${CMAKE_CURRENT_BINARY_DIR}/node-serve)
set_tests_properties(sampling_openai_node PROPERTIES LABELS integration SKIP_RETURN_CODE 77 TIMEOUT 600)
# response_format (json_schema outputs validate for 50 seeds) and forced tool calls on demo-v4, a model that
# knows no JSON, through the `openai` npm client against `numoe serve` (skipped like router_openai_node).
add_test(NAME structured_openai_node
  COMMAND bash ${CMAKE_CURRENT_SOURCE_DIR}/node/run_serve_test.sh $<TARGET_FILE:numoe> ${NUMOE_TEST_DATA}/demo-v4
          ${CMAKE_CURRENT_BINARY_DIR}/node-structured structured_test.mjs)
set_tests_properties(structured_openai_node PROPERTIES LABELS integration SKIP_RETURN_CODE 77 TIMEOUT 600)

# The end-to-end check: `numoe serve` (numoe-gpu + 4 numoe-workers + numoe-router) on tiny-v4.
numoe_add_test(router_e2e_test
  SOURCES router_e2e_test.cc
  LIBS numoe_proto numoe_common nlohmann_json::nlohmann_json
  LABELS integration TIMEOUT 900)
add_dependencies(router_e2e_test numoe numoe-gpu numoe-worker numoe-router)
