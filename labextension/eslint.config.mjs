// `jlpm lint:check` (part of `make lint`): eslint's and typescript-eslint's recommended rules on src/; layout is
// prettier's business (eslint-config-prettier turns off the rules that would fight it).
import js from "@eslint/js";
import prettier from "eslint-config-prettier";
import tseslint from "typescript-eslint";

export default tseslint.config(
  { ignores: ["lib/", "dist/", "node_modules/", "style/"] },
  js.configs.recommended,
  ...tseslint.configs.recommended,
  prettier,
  {
    files: ["src/**/*.ts"],
    rules: {
      // as in JupyterLab's extension template: the lab's JSON replies and uPlot's hooks are typed where they are read
      "@typescript-eslint/no-explicit-any": "off",
      // as in JupyterLab's extension template: `namespace CommandIDs` is JupyterLab's idiom for command ids
      "@typescript-eslint/no-namespace": "off",
      // `_` marks an argument or binding kept for its position (callbacks, destructuring)
      "@typescript-eslint/no-unused-vars": ["error", { argsIgnorePattern: "^_", varsIgnorePattern: "^_" }],
    },
  },
);
