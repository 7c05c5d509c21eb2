// Fixed texts of the DeepSeek V4 chat encoding, verbatim from docs/dsv4-chat-encoding.md (§1 special
// strings, §2.3 tools block), for tests that compose expected prompts by hand from the doc's rules.
#pragma once

#include <string>

namespace numoe::test {

inline const std::string B = "<｜begin▁of▁sentence｜>";
inline const std::string E = "<｜end▁of▁sentence｜>";
inline const std::string U = "<｜User｜>";
inline const std::string A = "<｜Assistant｜>";

// §2.3, verbatim, with {TOOL_SCHEMAS} as a parameter.
inline std::string ToolsBlock(const std::string& schemas) {
  return R"(## Tools

You have access to a set of tools to help answer the user's question. You can invoke tools by writing a "<｜DSML｜tool_calls>" block like the following:

<｜DSML｜tool_calls>
<｜DSML｜invoke name="$TOOL_NAME">
<｜DSML｜parameter name="$PARAMETER_NAME" string="true|false">$PARAMETER_VALUE</｜DSML｜parameter>
...
</｜DSML｜invoke>
<｜DSML｜invoke name="$TOOL_NAME2">
...
</｜DSML｜invoke>
</｜DSML｜tool_calls>

String parameters should be specified as is and set `string="true"`. For all other types (numbers, booleans, arrays, objects), pass the value in JSON format and set `string="false"`.

If thinking_mode is enabled (triggered by <think>), you MUST output your complete reasoning inside <think>...</think> BEFORE any tool calls or final response.

Otherwise, output directly after </think> with tool calls or final response.

### Available Tool Schemas

)" + schemas + R"(

You MUST strictly follow the above defined tool name and parameter schemas to invoke tool calls.
)";
}

}  // namespace numoe::test
